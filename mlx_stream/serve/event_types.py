"""What one request's ``emit`` receives from the engine's worker, a class per kind.

Contract: :class:`Started` first (or :class:`Failed`), then :class:`Prefill` while the
prompt goes in (a request that asked for progress), :class:`Delta` per segment of text
(:class:`Reasoning` for a thought, :class:`ToolCall` per call, written by the streams
of :mod:`~mlx_stream.serve.reasoning` and :mod:`~mlx_stream.serve.tools`), then
:class:`End` or :class:`Failed`. A failure carries the exception; what it means on the
wire is the HTTP side's (:mod:`~mlx_stream.serve.statuses`). Consumers ignore kinds they
do not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Started:
    """The request runs on a session (``session_id``; ``None`` for a transient one);
    ``note``: a line for the access log (an edit rebuilt, resumed...)."""

    session_id: str | None
    note: str | None = None


@dataclass(frozen=True)
class Prefill:
    """``done`` of the prompt's ``total`` tokens are in the session's caches."""

    done: int
    total: int


@dataclass(frozen=True)
class Delta:
    """A segment of the reply's text; ``logprob``: its token's entry
    (:class:`~mlx_stream.serve.logprobs.TokenLogprobs`) when the request asked."""

    text: str
    logprob: Any = None


@dataclass(frozen=True)
class Reasoning:
    """A segment of the thought before the answer."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """The reply's ``index``-th tool call, in OpenAI's shape."""

    index: int
    call: dict


@dataclass(frozen=True)
class End:
    """The reply is done: its ``usage`` counts and why it ended (``stop``, ``length``,
    ``tool_calls``, ``loop``)."""

    usage: dict
    finish_reason: str

    def with_reasoning(self, tokens: int) -> End:
        """This end, its usage counting ``tokens`` of the reply as reasoning
        (``completion_tokens_details.reasoning_tokens``)."""
        details = dict(self.usage.get("completion_tokens_details") or {})
        usage = {**self.usage, "completion_tokens_details": {**details, "reasoning_tokens": tokens}}
        return End(usage, self.finish_reason)


@dataclass(frozen=True)
class Failed:
    """The request ended with ``error`` (a refusal of :mod:`~mlx_stream.serve.refusals`
    or an unexpected exception); ``crashed``: raised while it ran, not at its admission
    (the server's fault, whatever the exception). The server goes on."""

    error: BaseException
    crashed: bool = False


Event = Started | Prefill | Delta | Reasoning | ToolCall | End | Failed
