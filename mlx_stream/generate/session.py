"""A conversation held in a fixed-size KV cache: what ``chat`` and ``serve`` share.

Contract: a :class:`ChatSession` owns a transcript (system prompt + user/assistant
turns), the SinkCaches that hold its rendered conversation, and the text the caches
hold (``fed_text``). Each turn renders the whole conversation through the model's chat
template and feeds only the text beyond ``fed_text``, so memory stays fixed however
long the conversation runs; a template that rewrites earlier turns falls back to
rendering the new message alone (mlx-lm's ``chat`` approach). A recall tier of the
caches is the session's too: checkpoints rewind it, caches replaced (reset, load) close
it and remove its files. The session knows nothing about terminals or HTTP: callers
pass a ``write`` callback and a ``stop`` predicate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.defaults import DEFAULT_MAX_TOKENS, DEFAULT_NUM_DRAFT_TOKENS
from mlx_stream.errors import RuntimeFailure, UserError
from mlx_stream.generate.prefill import PREFILL_STEP, feed_steps
from mlx_stream.generate.saving import (
    PRIVATE,
    STATE_FIELDS,  # noqa: F401 - re-exported
    STATE_KEY,
    check_state,
    checkpoint_paths,
    draft_cache_path,
    write_text_atomic,
)
from mlx_stream.generate.transcript import (
    SENTINEL,
    ZERO_WIDTH_SPACE,  # noqa: F401 - re-exported
    as_user,
    clean_text,  # noqa: F401 - re-exported
    escape_specials,
    new_messages,
    special_texts,
)


@dataclass
class Settings:
    """Per-session settings: the cache policy, and generation's (``stream_generate``'s
    names and defaults)."""

    cache: CacheSpec
    keep_system: bool = False
    pin_limit: int | None = None  # most sinks ``keep_system`` pins; the rest flows
    max_tokens: int = DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    stop_loops: int = 0  # end a reply that repeats itself (``stream_generate``'s); 0: never
    # Token ids besides eos that end a reply (``model_config.end_of_turn_tokens``).
    stop_tokens: tuple[int, ...] = ()

    def cache_spec(self, sinks: int | None = None, drafting: bool = True) -> CacheSpec:
        """The policy of a session's caches: ``cache`` with ``sinks`` (the rendered
        system prompt under ``keep_system``) and, when ``drafting``, room for a
        speculative verify block (without a draft model no slack: a decode step then
        attends over no masked slot)."""
        spec = self.cache if sinks is None else self.cache.replace(sinks=sinks)
        return spec.for_draft(self.num_draft_tokens) if drafting else spec


@dataclass
class Reply:
    """One finished (or interrupted) reply."""

    text: str
    tokens: int
    tps: float
    prompt_tokens: int
    interrupted: bool = False
    finish_reason: str | None = None
    prompt_tps: float = 0.0


def cache_count(caches: list) -> int:
    """Tokens the first cache of ``caches`` has consumed."""
    c = caches[0]
    return int(getattr(c, "tokens_seen", c.offset))


@dataclass
class Checkpoint:
    """A session's conversation and caches at one moment (see ``ChatSession.checkpoint``)."""

    messages: list[dict[str, str]]
    fed_text: str
    pending: list[int]
    system: str | None
    sinks: int
    caches: list
    recall: Any = None  # the recall tier's mark (tier.Recall.mark): the copies share it
    tokens: list[int] | None = None


@dataclass
class ChatSession:
    """A conversation: transcript, KV caches and what they hold.

    Attributes:
        messages: The user/assistant turns (the system prompt is kept apart).
        fed_text: The rendered conversation whose tokens are in the caches, apart from
            ``pending``.
        pending: Tokens of ``fed_text`` the caches have not seen yet (the last sampled
            token of a reply is sampled but not fed); fed at the start of the next turn.
        tokens: The token ids the caches hold, in order (``None``: not known, e.g. a
            chat saved before they were recorded); what an edit's repair diffs.
    """

    model: Any
    tokenizer: Any
    settings: Settings
    system: str | None = None
    draft_model: Any = None
    messages: list[dict[str, str]] = field(default_factory=list)
    fed_text: str = ""
    pending: list[int] = field(default_factory=list)
    tokens: list[int] | None = field(default_factory=list)
    sinks: int = 0
    caches: list = field(default_factory=list)
    n_target: int = 0
    last: Reply | None = None
    specials: tuple[str, ...] | None = field(default=None, repr=False)
    tools: Any = None  # a serve.tools.ToolSet: tool definitions shown to the template
    thinking: bool | None = None  # the template's enable_thinking (mlx-lm's wrapper renames it)
    # A PrefixStore: a first turn starts from its system prompt's caches (put there on a miss).
    prefix_store: Any = None

    def __post_init__(self) -> None:
        self.reset()

    # ----- rendering ----------------------------------------------------------------

    def conversation(self, messages: list[dict[str, str]] | None = None) -> list[dict]:
        """The system prompt (if any) followed by ``messages`` (default: the transcript).

        Special-token text in what the user (or the system prompt, or a tool) wrote is
        escaped (:func:`escape_specials`); the assistant's own replies are left as the
        model wrote them, so a transcript renders to what its caches hold.
        """
        head = [{"role": "system", "content": self.system}] if self.system else []
        out = head + list(self.messages if messages is None else messages)
        if self.specials is None:
            self.specials = special_texts(self.tokenizer)
        return [
            m
            if m["role"] == "assistant"
            else {**m, "content": escape_specials(m["content"], self.specials)}
            for m in out
        ]

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` through the chat template (plain lines without one)."""
        tok = self.tokenizer
        extra: dict[str, Any] = {} if self.thinking is None else {"enable_thinking": self.thinking}
        if self.tools is not None:
            messages, tool_extra = self.tools.for_template(messages)
            extra |= tool_extra
        if not getattr(tok, "chat_template", None):
            return "".join(m["content"] + "\n" for m in messages)
        try:
            return tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except Exception:  # noqa: BLE001 - a template that takes a system message first only
            if not any(m["role"] == "system" for m in messages[1:]):
                raise
            messages = messages[:1] + [as_user(m) for m in messages[1:]]
            return tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )

    def encode(self, text: str) -> list[int]:
        """Tokens of rendered text (the template writes any BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def system_text(self) -> str:
        """The rendered system prompt: what ``keep_system`` makes the sinks.

        Without a system prompt, a template that writes a default one (SmolLM2's does)
        keeps that: everything rendered before the first user message. Returns ``""``
        when there is no system prompt at all.
        """
        first_turn = [{"role": "user", "content": SENTINEL}]
        full = self.render(self.conversation(first_turn))
        if self.system:
            text = self.render(self.conversation([]), add_generation_prompt=False)
            if full.startswith(text):
                return text
        head = full[: full.index(SENTINEL)] if SENTINEL in full else ""
        if not self.system and "system" not in head:
            return ""
        return head

    def system_tokens(self) -> int:
        """Tokens of :meth:`system_text` (0 without a system prompt)."""
        text = self.system_text()
        return len(self.encode(text)) if text else 0

    def turn_tokens(self, user_text: str | list[dict]) -> tuple[list[int], str]:
        """Tokens to feed for a new user message (or new messages: tool results), and
        the rendered conversation after it."""
        messages = self.messages + new_messages(user_text)
        full = self.render(self.conversation(messages))
        if full.startswith(self.fed_text):
            new = full[len(self.fed_text) :]
        else:
            # The template rewrote earlier turns: render the new message alone.
            new = self.render(new_messages(user_text))
            bos = getattr(self.tokenizer, "bos_token", None)
            if bos and new.startswith(bos):
                new = new[len(bos) :]
        return self.pending + self.encode(new), full

    # ----- engine calls -------------------------------------------------------------

    def make_caches(self) -> list:
        """Fresh SinkCaches for the model (and the draft model after it)."""
        spec = self.settings.cache_spec(self.sinks, drafting=self.draft_model is not None)
        caches = spec.build(self.model)
        self.n_target = len(caches)
        if self.draft_model is not None:  # the recall tier serves the target only
            caches += spec.replace(recall=None).build(self.draft_model)
        return caches

    def generate(self, tokens: list[int], **overrides: Any) -> Iterator[Any]:
        """The engine's streaming generator over ``tokens`` with the session's caches;
        ``overrides`` replace settings for this call (``max_tokens``, ``temp``,
        ``top_p``, ...) or add ``stream_responses`` arguments (``stop``, ``seed``)."""
        from mlx_stream.generate.decode import stream_responses

        s = self.settings
        kwargs = {"max_tokens": s.max_tokens, "temp": s.temp, "top_p": s.top_p}
        if s.top_k or s.min_p or s.repetition_penalty or s.stop_tokens:
            kwargs.update(top_k=s.top_k, min_p=s.min_p, stop_tokens=s.stop_tokens,
                          repetition_penalty=s.repetition_penalty)  # fmt: skip
        if s.stop_loops:
            kwargs["stop_loops"] = s.stop_loops
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return stream_responses(
            self.model,
            self.tokenizer,
            tokens,
            draft_model=self.draft_model,
            num_draft_tokens=s.num_draft_tokens,
            prompt_cache=self.caches,
            **kwargs,
        )

    def prefill(self, text: str) -> None:
        """Feed ``text`` (rendered, the start of the conversation) into empty caches."""
        for _ in self.prefill_steps(text):
            pass

    def prefill_steps(self, text: str) -> Iterator[int]:
        """:meth:`prefill`, a model call at a time: yields the tokens fed so far after
        each call (a caller may serve others between them)."""
        tokens = self.encode(text)
        groups = [(self.model, self.caches[: self.n_target])]
        if self.draft_model is not None:
            groups.append((self.draft_model, self.caches[self.n_target :]))
        fed = 0
        for group in groups:
            for done in feed_steps([group], tokens, PREFILL_STEP):
                yield fed + done
            fed += len(tokens)
        self.fed_text, self.pending, self.tokens = text, [], tokens

    def prefix_key(self, text: str, store: Any = None) -> Any:
        """The key in ``store`` (default: :attr:`prefix_store`) of these caches after
        ``text`` (rendered, the start of the conversation), or ``None`` where no entry
        may serve them: a draft model, a recall tier (its store lives beside the caches)
        or a prefix under ``prefix_store.MIN_TOKENS`` tokens."""
        from mlx_stream import prefix_store

        if self.draft_model is not None or self.settings.cache.recall is not None:
            return None
        tokens = self.encode(text)
        if len(tokens) < prefix_store.MIN_TOKENS:
            return None
        spec = self.settings.cache_spec(self.sinks, drafting=False)
        weights = getattr(store or self.prefix_store, "weights", None)  # None: by content
        return prefix_store.make_key(self.model, tokens, spec, PREFILL_STEP, weights)

    def prefill_stored(self, text: str, store: Any) -> Generator[int, None, bool]:
        """:meth:`prefill_steps` of ``text`` into empty caches, from ``store`` (a
        ``PrefixStore``) when it holds them (nothing is yielded then); on a miss the
        prefilled caches go into the store. Returns whether they came from the store."""
        key = self.prefix_key(text, store) if store is not None else None
        if key is not None:
            caches = store.lookup(key, self.model)
            if caches is not None and len(caches) == len(self.caches):
                self.caches, self.fed_text, self.pending = caches, text, []
                self.tokens = self.encode(text)
                return True
        yield from self.prefill_steps(text)
        if key is not None:
            store.put(key, self.caches)
        return False

    def _system_from_store(self, progress: Callable[[int, int], None] | None) -> None:
        """Before a first turn: the rendered system prompt from :attr:`prefix_store`
        (or prefilled, then stored), so a second process starts from it."""
        if self.fed_text or self.pending or cache_count(self.caches):
            return
        head = self.system_text()
        if not head or self.prefix_key(head) is None:
            return
        total = len(self.encode(head))
        for done in self.prefill_stored(head, self.prefix_store):
            if progress is not None:
                progress(done, total)

    # ----- conversation -------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation; keep the model, settings and system prompt."""
        self.messages, self.fed_text, self.pending, self.last = [], "", [], None
        self.tokens = []
        self.sinks = self.settings.cache.sinks
        if self.settings.keep_system:
            self.sinks = self.system_tokens()
            if self.sinks == 0:
                raise UserError("--keep-system needs a system prompt: pass --system TEXT")
            if self.settings.pin_limit is not None:
                self.sinks = min(self.sinks, self.settings.pin_limit)
        self.use_caches(self.make_caches())

    def use_caches(self, caches: list) -> None:
        """Hold ``caches`` from now on; a recall tier they do not share is closed and
        its files removed (a checkpoint of its caches can no longer be restored)."""
        from mlx_stream.recall import tier_of

        old = tier_of(self.caches) if self.caches else None
        self.caches = caches
        if old is not None and old is not tier_of(caches):
            old.close(remove_files=True)

    def close(self) -> None:
        """Free the caches, closing a recall tier (its files removed): the session ends."""
        self.use_caches([])

    def set_system(self, text: str | None) -> None:
        """Set the system prompt and start over (the cache holds the old one)."""
        self.system = text or None
        self.reset()

    def reply(self, user_text: str, write: Callable[[str], None], **overrides: Any) -> Reply:
        """Stream a reply to ``user_text`` through ``write``; Ctrl-C stops it early.

        The reply, finished or not, joins the transcript and the cache; an exception
        raised by ``write`` stops it the same way and is raised again afterwards.
        ``overrides``: per-call settings, see :meth:`generate`.
        """
        from mlx_stream.generate.decode import StopOnInterrupt

        turn = self.stream(user_text, **overrides)
        with StopOnInterrupt() as ctrl_c:
            try:
                for response in turn:
                    write(response.text)
                    if ctrl_c.interrupted:
                        break
            finally:
                turn.close()
        return self.last

    def stream(
        self, user_text: str | list[dict], turn: tuple | None = None, **overrides: Any
    ) -> Iterator[Any]:
        """Generate a reply to ``user_text``, yielding ``stream_generate``'s responses.

        However the generator ends (finished, or ``close()``-d by its consumer), the
        reply so far joins the transcript and the cache, and :attr:`last` describes it.
        With a polled token source (see
        :func:`~mlx_stream.generate.decode.stream_responses`) it yields ``None`` between
        prefill chunks; closed there, the caches hold part of the prompt: restore a
        checkpoint.

        Args:
            user_text (str | list[dict]): The new user message, or the new messages.
            turn (tuple, optional): :meth:`turn_tokens` of ``user_text``, when the
                caller already has it (to check its size first).
            **overrides: Per-call settings, see :meth:`generate`.
        """
        if turn is None and self.prefix_store is not None:
            self._system_from_store(overrides.get("prompt_progress_callback"))
        tokens, full = turn if turn is not None else self.turn_tokens(user_text)
        before = [cache_count(self.caches)]
        if self.draft_model is not None:
            before.append(cache_count(self.caches[self.n_target :]))
        generated: list[int] = []
        texts: list[str] = []
        last = None
        finished = False
        gen = self.generate(tokens, **overrides)
        try:
            for response in gen:
                if response is None:  # polled: no token yet (see stream_generate)
                    yield None
                    continue
                last = response
                generated.append(response.token)
                texts.append(response.text)
                yield response
            finished = True
        finally:
            gen.close()
            finish = getattr(last, "finish_reason", None)
            eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
            eos |= set(overrides.get("stop_tokens") or self.settings.stop_tokens)
            if generated and finish == "stop" and generated[-1] in eos:
                generated.pop()
            self._settle(before, len(tokens), generated)
            if self.tokens is not None:  # what went in: the prompt, then the reply
                self.tokens = (self.tokens + tokens + generated)[: cache_count(self.caches)]
            # The text the consumer saw (a stop string is cut from it).
            text = "".join(texts)
            self.messages += [*new_messages(user_text), {"role": "assistant", "content": text}]
            self.fed_text = full + text
            self.last = Reply(
                text=text,
                tokens=len(generated),
                tps=float(getattr(last, "generation_tps", 0.0) or 0.0),
                prompt_tokens=len(tokens),
                interrupted=not finished,
                finish_reason=finish,
                prompt_tps=float(getattr(last, "prompt_tps", 0.0) or 0.0),
            )

    # ----- checkpoints in memory ------------------------------------------------------

    def checkpoint(self) -> Checkpoint:
        """A copy of the conversation and its caches to :meth:`restore` later (costs
        one more cache: a fixed size). A recall tier is shared, not copied: the
        checkpoint keeps its mark."""
        import copy

        from mlx_stream.recall import tier_of

        tier = tier_of(self.caches)
        return Checkpoint(
            messages=[dict(m) for m in self.messages],
            fed_text=self.fed_text,
            pending=list(self.pending),
            system=self.system,
            sinks=self.sinks,
            caches=copy.deepcopy(self.caches),
            recall=tier.mark() if tier is not None else None,
            tokens=None if self.tokens is None else list(self.tokens),
        )

    def restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint``; it stays usable (its caches are copied again). A
        recall tier is rewound to it: it serves the restored caches, its store back
        to the checkpoint's blocks, its selections to the checkpoint's."""
        import copy

        from mlx_stream.recall import tier_of

        tier = tier_of(checkpoint.caches)
        if tier is not None and tier.closed:
            raise UserError(
                "this checkpoint's recall store was closed (the chat was reset or loaded since)"
            )
        caches = copy.deepcopy(checkpoint.caches)
        if tier is not None:
            tier.rewind(caches[: self.n_target], checkpoint.recall)
        self.messages = [dict(m) for m in checkpoint.messages]
        self.fed_text, self.pending = checkpoint.fed_text, list(checkpoint.pending)
        self.tokens = None if checkpoint.tokens is None else list(checkpoint.tokens)
        self.system, self.sinks = checkpoint.system, checkpoint.sinks
        self.use_caches(caches)
        self.last = None

    def _settle(self, before: list[int], n_prompt: int, generated: list[int]) -> None:
        """Make the caches hold exactly prompt + reply, apart from ``pending``.

        A decode loop that feeds the end-of-turn token it sampled (mlx-lm does) left
        one token too many: trim it, the next turn's template text brings it back. One
        that did not feed the last sampled token leaves it pending.
        """
        groups = [self.caches[: self.n_target]]
        if self.draft_model is not None:
            groups.append(self.caches[self.n_target :])
        fed = cache_count(groups[0]) - before[0] - n_prompt
        for group, start in zip(groups, before, strict=False):
            extra = cache_count(group) - start - n_prompt - len(generated)
            if extra > 0:
                for c in group:
                    if c.is_trimmable():
                        c.trim(extra)
        self.pending = generated[max(0, fed) :]

    # ----- inspection and checkpoints -------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters for ``/stats`` and the line after each reply."""
        from mlx_stream.cache.reclaim import memory_snapshot

        first = self.caches[0]
        seen = cache_count(self.caches)
        mem = memory_snapshot()
        return {
            "turns": len(self.messages) // 2,
            "tokens_seen": seen,
            "sinks": self.sinks,
            "window": self.settings.cache.window,
            "sinks_used": min(seen, self.sinks),
            "window_used": min(max(0, seen - self.sinks), self.settings.cache.window),
            "cache_bytes": sum(int(getattr(c, "nbytes", 0) or 0) for c in self.caches),
            "capacity": getattr(first, "capacity", None),
            "active_memory": mem.active,
            "cache_memory": mem.cache,
            "peak_memory": mem.peak,
        }

    def state(self) -> dict[str, Any]:
        """What ``/save`` stores besides the KV cache."""
        return {
            "version": 1,
            "system": self.system,
            "messages": self.messages,
            "fed_text": self.fed_text,
            "pending": self.pending,
            "tokens": self.tokens,
            "sinks": self.sinks,
            "window": self.settings.cache.window,
            "keep_system": self.settings.keep_system,
        }

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Save the KV cache (its written slots only) and the transcript, each file
        atomically and private (``PRIVATE``: a conversation is the user's own); with a
        draft model its cache goes to ``PATH.draft.safetensors``; a recall tier's store
        to the folder ``PATH.recall`` (with its checksums; ``save_cache``)."""
        from mlx_stream.cache.sink import save_cache

        cache_path, transcript_path = checkpoint_paths(path)
        state = self.state()
        try:
            meta = {STATE_KEY: json.dumps(state)}
            save_cache(cache_path, self.caches[: self.n_target], meta, mode=PRIVATE)
            if self.draft_model is not None:
                save_cache(draft_cache_path(cache_path), self.caches[self.n_target :], mode=PRIVATE)
            text = json.dumps(state, indent=2, ensure_ascii=False) + "\n"
            write_text_atomic(transcript_path, text)
        except OSError as exc:
            where = exc.filename or cache_path
            raise RuntimeFailure(f"{where}: cannot save ({exc.strerror or exc})") from exc
        return cache_path, transcript_path

    def load(self, path: str | Path) -> Path:
        """Restore a conversation saved by :meth:`save` (its recall store too, which
        must have been made with this session's recall settings)."""
        from mlx_stream.cache.sink import load_cache

        cache_path, _ = checkpoint_paths(path)
        draft_path = draft_cache_path(cache_path)
        if not cache_path.is_file():
            raise UserError(f"{cache_path}: no such file")
        if self.draft_model is not None and not draft_path.is_file():
            raise UserError(f"{cache_path}: saved without a draft model (no {draft_path.name})")
        try:
            caches, meta = load_cache(cache_path, self.model, self.settings.cache.recall)
            state = json.loads(meta[STATE_KEY])
            if self.draft_model is not None:
                caches += load_cache(draft_path, self.draft_model)[0]
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise UserError(f"{cache_path}: not a chat saved with /save ({exc})") from exc
        if len(caches) != len(self.caches):
            raise UserError(
                f"{cache_path}: saved for another model ({len(caches)} cache layers, not {len(self.caches)})"
            )
        state = check_state(state, cache_path)
        self.use_caches(caches)
        self.system = state["system"]
        self.messages = state["messages"]
        self.fed_text = state["fed_text"]
        self.pending = state["pending"]
        tokens = state.get("tokens")  # absent from chats saved before it was recorded
        ok = isinstance(tokens, list) and all(type(t) is int for t in tokens)
        self.tokens = tokens if ok and len(tokens) == cache_count(caches) else None
        self.sinks = state["sinks"]
        self.settings.cache = self.settings.cache.replace(window=state["window"])
        self.last = None
        return cache_path
