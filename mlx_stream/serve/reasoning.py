"""Reasoning kept apart from the answer, for models that think before they reply.

Contract: for a tokenizer whose markers of a thought mlx-lm infers (``<think>`` /
``</think>``: DeepSeek-R1, Qwen3, QwQ ...), a :class:`ThinkStream` splits a chat
request's ``Delta`` events: the thought (between the markers, or from the first token
when the prompt left one open) becomes ``Reasoning`` events, the markers go nowhere, the
rest stays text (one thought per reply); gpt-oss's harmony channels go apart in a
:class:`~mlx_stream.serve.harmony.HarmonyStream` (:func:`reader` picks). Tool calls are
read from the answer only. The ``End`` event's usage gains ``completion_tokens_details.reasoning_tokens``. A model
without markers gets no stream; the transcript keeps the reply as generated. In full:
docs/serve.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_stream.serve.event_types import Delta, End, Reasoning
from mlx_stream.serve.harmony import ANALYSIS, CALL_START, HarmonyStream, speaks
from mlx_stream.serve.tools import CallStream, hold_back, settle_after


def markers(tokenizer: Any) -> tuple[str, str] | None:
    """The model's thinking markers ``(start, end)``, or ``None`` (it does not think);
    harmony's are its ``analysis`` message's (its thought is read by channel)."""
    if speaks(tokenizer):
        return ANALYSIS
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not getattr(tokenizer, "has_thinking", False) or not start or not end:
        return None
    return start, end


def reader(tokenizer: Any, emit: Any) -> Any:
    """``emit`` (a chat request's callback) behind the stream that keeps
    ``tokenizer``'s thought apart: harmony's, the think markers', or none (``emit``)."""
    if speaks(tokenizer):
        calls = isinstance(emit, CallStream) and emit.plan.choice != "none"
        calls = calls and emit.plan.start == CALL_START  # not a forced call's markers
        return HarmonyStream(emit, calls=calls)
    marks = markers(tokenizer)
    return ThinkStream(marks, emit) if marks is not None else emit


def left_open(prompt: str, marks: tuple[str, str]) -> bool:
    """Whether ``prompt`` (rendered, with its generation prompt) ends inside a thought."""
    return prompt.rfind(marks[0]) > prompt.rfind(marks[1])


@dataclass
class ThinkStream:
    """A request's event callback that routes its thought to ``Reasoning`` events."""

    # By hand: mlx-lm splits thinking inside its server's generation loop (a token
    # state machine), not in a function it exports.

    marks: tuple[str, str]
    emit: Any
    thinking: bool = False  # inside a thought (set from the prompt: :func:`left_open`)
    held: str = ""  # text that may begin the marker awaited
    tokens: int = 0  # segments routed to reasoning
    strip: bool = False  # drop the blank lines between a thought and the answer
    done: bool = False  # the thought has ended
    counted: bool = False

    def prompt(self, text: str) -> None:
        """The rendered prompt the reply follows: whether it opened a thought."""
        self.thinking = left_open(text, self.marks)

    def __call__(self, event: Any) -> None:
        if isinstance(event, Delta):
            self._feed(event.text, event.logprob)
        elif isinstance(event, End):
            self._flush()
            self.emit(event.with_reasoning(self.tokens))
        else:
            self.emit(event)

    def settle(self, session: Any) -> None:
        """The tool-call reader's :meth:`~mlx_stream.serve.tools.CallStream.settle`."""
        settle_after(self.emit, session)

    def _feed(self, text: str, logprob: Any) -> None:
        self.counted = False  # this segment (a sampled token) not yet counted as thought
        self.held += text
        while True:
            if self.done:  # one thought per reply: a later marker is the answer's text
                held, self.held = self.held, ""
                self._out(held, logprob)
                return
            marker = self.marks[1] if self.thinking else self.marks[0]
            at = self.held.find(marker)
            if at < 0:
                out, self.held = hold_back(self.held, marker)
                self._out(out, logprob)
                return
            self._out(self.held[:at], logprob)
            logprob = None
            self.held = self.held[at + len(marker) :]
            self.done, self.thinking = self.thinking, not self.thinking
            self.strip = self.done  # the answer starts past the thought's blank line

    def _out(self, text: str, logprob: Any) -> None:
        if self.thinking:
            if text:
                self.tokens += not self.counted
                self.counted = True
                self.emit(Reasoning(text))
            return
        if self.strip:
            text = text.lstrip("\n")
            self.strip = not text
        if text or logprob is not None:
            self.emit(Delta(text, logprob))

    def _flush(self) -> None:
        held, self.held = self.held, ""
        self._out(held, None)


STREAMS = (ThinkStream, HarmonyStream)  # what :func:`reader` wraps a callback in
