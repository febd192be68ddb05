"""gpt-oss's harmony format: a reply's messages told apart by their channel.

Contract: for a tokenizer that speaks harmony (:func:`speaks`: ``<|channel|>`` and
``<|message|>`` are tokens of its vocabulary), a :class:`HarmonyStream` reads a chat
request's ``Delta`` events as OpenAI's documented sequence of messages,
``[<|start|>assistant][ to=R]<|channel|>CHANNEL[ to=R][ <|constrain|>json]<|message|>BODY``,
each ended by ``<|end|>``, by ``<|return|>`` or ``<|call|>`` (they end the turn: the
engine stops at them) or by the reply's end. ``analysis`` becomes ``Reasoning``
events; ``final`` and a ``commentary`` without a recipient (a preamble shown to the
user) text; a message to ``functions.NAME`` a call, passed on to the tool-call reader
in the one header :mod:`~mlx_stream.serve.call_formats`' harmony format reads (as its
arguments' text where the request has no tool reader). Text before any header (a
forced call's grammar writes none) is text. The markers reach no client, not even one
out of place. The ``End`` event's usage gains
``completion_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mlx_stream.mlxlm import hf_tokenizer
from mlx_stream.serve.event_types import Delta, End, Reasoning
from mlx_stream.serve.tools import hold_back, settle_after

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's last token
HEADS = ("<|start|>", CHANNEL, " to=")  # what a message's header may begin with
ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>")  # a thought's start and end
CALL_START, CALL_END = "<|channel|>commentary to=functions.", "<|call|>"
MARKERS = ("<|start|>", CHANNEL, "<|constrain|>", MESSAGE, *ENDS)
STRAY = re.compile("|".join(re.escape(m) for m in MARKERS))  # one out of place
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def speaks(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s vocabulary has harmony's ``<|channel|>`` and ``<|message|>``
    (asked of a fast tokenizer's core: a large vocabulary is not copied per request)."""
    core = getattr(hf_tokenizer(tokenizer), "backend_tokenizer", None)
    if core is not None:
        return core.token_to_id(CHANNEL) is not None and core.token_to_id(MESSAGE) is not None
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, TypeError):
        return False
    return CHANNEL in vocab and MESSAGE in vocab


def call_text(name: str, body: str) -> str:
    """A call in the header :mod:`~mlx_stream.serve.call_formats` reads (the recipient
    after the channel, as OpenAI's examples write it)."""
    return f"{CALL_START}{name} <|constrain|>json{MESSAGE}{body}{CALL_END}"


def _hold(text: str, markers: tuple[str, ...]) -> tuple[str, str]:
    """:func:`~mlx_stream.serve.tools.hold_back` for the first of several markers."""
    out, held = text, ""
    for marker in markers:
        rest, tail = hold_back(text, marker)
        if len(tail) > len(held):
            out, held = rest, tail
    return out, held


@dataclass
class HarmonyStream:
    """A request's event callback that routes harmony's channels (module docstring)."""

    # Ours: mlx-lm 0.32 has no harmony parser (its tool_parsers read none of these
    # headers, and it infers no thinking markers for ``<|channel|>``).

    emit: Any
    calls: bool = False  # ``emit`` reads calls in :func:`call_text`'s form
    held: str = ""  # text not yet routed: a header, or text that may begin a marker
    kind: str | None = None  # the open message's: reasoning | text | call; None: a header
    name: str = ""  # the open call's function
    body: str = ""  # the open call's arguments
    started: bool = False  # some message has begun
    tokens: int = 0  # segments routed to reasoning
    counted: bool = False

    def __call__(self, event: Any) -> None:
        if isinstance(event, Delta):
            self.counted = False
            self.held += event.text
            self._route(event.logprob)
        elif isinstance(event, End):
            self._end()
            self.emit(event.with_reasoning(self.tokens))
        else:
            self.emit(event)

    def settle(self, session: Any) -> None:
        """The tool-call reader's :meth:`~mlx_stream.serve.tools.CallStream.settle`."""
        settle_after(self.emit, session)

    def _route(self, logprob: Any) -> None:
        while True:
            if self.kind is None and not self._header():  # wait for the rest of a header
                return
            ends = [(at, m) for m in ENDS if (at := self.held.find(m)) >= 0]
            if not ends:
                out, self.held = _hold(self.held, MARKERS)  # ends, or one to drop
                self._out(out, logprob)
                return
            at, marker = min(ends)
            self._out(self.held[:at], logprob)
            logprob, self.held = None, self.held[at + len(marker) :]
            self._close()

    def _header(self) -> bool:
        """Opens the next message from the held text; ``False``: wait for more."""
        text = self.held.lstrip() if self.started else self.held
        if not any(text.startswith(h) for h in HEADS):
            if any(h.startswith(text) for h in HEADS):
                return False  # may still begin a header
            self.kind, self.started = "text", True  # text outside any message
            return True
        at = text.find(MESSAGE)
        if at < 0:
            return False
        header, self.held, self.started = text[:at], text[at + len(MESSAGE) :], True
        recipient, channel = RECIPIENT.search(header), CHANNEL_NAME.search(header)
        if recipient is not None and recipient.group(1) != "assistant":
            self.kind, self.body = "call", ""
            self.name = recipient.group(1).removeprefix("functions.")
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "text"
        return True

    def _out(self, text: str, logprob: Any) -> None:
        """``text`` of the open message to its place (a thought's or call's token
        gives no logprob entry, as with :class:`~mlx_stream.serve.reasoning.ThinkStream`)."""
        if self.kind == "call":
            self.body += text
            return
        text = STRAY.sub("", text)  # a marker where none belongs reaches no client either
        if self.kind == "reasoning":
            if text:
                self.tokens += not self.counted
                self.counted = True
                self.emit(Reasoning(text))
        elif text or logprob is not None:
            self.emit(Delta(text, logprob))

    def _end(self) -> None:
        """The reply is over: the open message ends with what is held (an unfinished
        header is dropped: it is markers)."""
        if self.kind is not None:
            held, self.held = self.held, ""
            self._out(held, None)
            self._close()
        self.held = ""

    def _close(self) -> None:
        """Ends the open message: a call goes to the tool-call reader."""
        if self.kind == "call":
            body = self.body.strip()
            self.emit(Delta(call_text(self.name, body) if self.calls else body))
        self.kind, self.name, self.body = None, "", ""
