"""A request planned for the worker: the HTTP side's :class:`~mlx_stream.serve.scheduler.Request`
is never changed; planning returns a new one with the server's defaults filled in.

Contract: :meth:`Planner.bound` gives the request its ``max_tokens`` (its own, else the
server's default, never over the operator's ceiling) and refuses a new message over
``max_prompt_tokens`` (:class:`TooLarge`). :meth:`Planner.plan` checks a request's agent
fields before any session is touched: its messages in the engine's shape, its tool plan,
its sampling arguments and grammar; with tools, its ``emit`` is a
:class:`~mlx_stream.serve.tools.CallStream`; for a model that thinks, a
:class:`~mlx_stream.serve.reasoning.ThinkStream` (or harmony's stream) before it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from mlx_stream.generate.session import clean_text
from mlx_stream.mlxlm import hf_tokenizer
from mlx_stream.serve.refusals import BadRequest, TooLarge


@dataclass
class Planned:
    """A request ready for the worker: ``request`` (a new object: the caller's is
    untouched), its tool plan (``None`` without tools) and its sampling overrides."""

    request: Any
    plan: Any = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def toolset(self) -> Any:
        return self.plan.toolset if self.plan is not None else None


class Planner:
    """Plans requests for one model: its tokenizer, the server's sampling defaults,
    settings (``max_tokens``) and limits. The grammar compiler and vocabulary size are made on first use."""

    def __init__(
        self, tokenizer: Any, sampling: Any, settings: Any, *, draft: bool,
        max_prompt_tokens: int, max_tokens_ceiling: int | None,
    ):  # fmt: skip
        self.tokenizer, self.sampling, self.draft = tokenizer, sampling, draft
        self.settings, self.max_prompt_tokens = settings, max_prompt_tokens
        self.max_tokens_ceiling = max_tokens_ceiling
        self._grammars, self._vocab = None, None

    def bound(self, request: Any) -> Any:
        """A copy of ``request`` with its ``max_tokens``; :class:`TooLarge` for a new
        message over ``max_prompt_tokens``, counted before any matching or prefill
        (what a turn feeds in all, its history included, is checked once it is
        matched)."""
        max_tokens = request.max_tokens
        if max_tokens is None or max_tokens <= 0:
            max_tokens = self.settings.max_tokens
        ceiling = self.max_tokens_ceiling
        if ceiling is not None and max_tokens > ceiling:
            max_tokens = ceiling
        if request.messages is not None:
            text = request.messages[-1].get("content", "") if request.messages else ""
        else:
            text = request.prompt or ""
        given = self.count(clean_text(text))
        if given > self.max_prompt_tokens:
            raise TooLarge(
                f"the prompt has {given:,} tokens; this server takes at most "
                f"{self.max_prompt_tokens:,} per request (--max-prompt-tokens)"
            )
        return dataclasses.replace(request, max_tokens=max_tokens)

    def count(self, text: str) -> int:
        """Tokens of ``text``; with a fast tokenizer's Rust core (which keeps no
        per-call state and lets go of the GIL), from any thread."""
        core = self.fast_core()
        if core is not None:
            return len(core.encode(text, add_special_tokens=False).ids)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def fast_core(self) -> Any:
        """The fast tokenizer's Rust core, or ``None`` (then only the worker counts)."""
        return getattr(hf_tokenizer(self.tokenizer), "backend_tokenizer", None)

    def plan(self, request: Any) -> Planned:
        """``request``'s tool plan and sampling arguments, as a new request."""
        from mlx_stream.serve import reasoning, sampling, tools

        plan, changes = None, {}
        if request.messages is not None:
            messages = tools.canonical_messages(request.messages)
            tools.check_results(messages)
            plan = tools.ToolPlan.make(request.tools, request.tool_choice, self.tokenizer)
            changes["messages"] = messages
        elif request.tools:
            raise BadRequest("tools: only chat requests take tools")
        planned = dataclasses.replace(request, **changes)
        constraint = self._constraint(planned, plan)
        penalty = sampling.resolve(planned, self.sampling, draft=self.draft)  # fills planned's
        if planned.repetition_penalty is not None:  # the request's own
            if self.draft:
                raise BadRequest("repeat_penalty: not supported with a draft model")
            penalty = planned.repetition_penalty if planned.repetition_penalty != 1.0 else None
        extra = sampling.overrides(
            planned, planned.temp, planned.top_p, self.vocab(), constraint, draft=self.draft,
            repetition_penalty=penalty,
        )  # fmt: skip
        if not isinstance(planned.emit, (tools.CallStream, *reasoning.STREAMS)):
            if plan is not None:
                salt = json.dumps(planned.messages[-1], sort_keys=True) + str(len(planned.messages))
                planned.emit = tools.CallStream(plan, planned.emit, salt=salt)
            if request.messages is not None:  # the thought first, then calls read from the answer
                planned.emit = reasoning.reader(self.tokenizer, planned.emit)
        return Planned(planned, plan, extra)

    def vocab(self) -> int:
        if self._vocab is None:
            self._vocab = len(self.tokenizer.get_vocab())
        return self._vocab

    def _constraint(self, request: Any, plan: Any) -> Any:
        """The grammar the reply must match: a response_format outranks an auto call's."""
        from mlx_stream.serve.structured import Grammars

        grammar = request.grammar
        if plan is not None and plan.grammar and (grammar is None or plan.choice != "auto"):
            grammar = plan.grammar
        if grammar is None:
            return None
        self._grammars = self._grammars or Grammars(self.tokenizer)
        return self._grammars.constraint(grammar)
