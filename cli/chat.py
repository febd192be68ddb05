"""``mlx-stream chat``: a terminal chat that never hits a context limit.

The conversation lives in one SinkCache kept across turns: each turn feeds only what
is new (the end of the previous reply's turn, the user message, the assistant header),
so memory stays fixed however long the chat runs. To find what is new, the whole
conversation is rendered through the model's chat template and the text beyond what
the cache already holds is fed; a template that rewrites earlier turns falls back to
rendering the new message alone (mlx-lm's ``chat`` approach).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli import options as opt
from cli.common import (
    atomic_path,
    atomic_write_text,
    check_kv_bits,
    check_output_path,
    check_positive,
    check_sampling,
    error_line,
    fail,
    handle_errors,
    is_interactive,
    load_model,
    sizes,
)

PROMPT = ">>> "
HELP = """\
/help          this help
/reset         forget the conversation (keeps the system prompt)
/stats         tokens, cache fill and memory
/system TEXT   set the system prompt and start over (/system alone clears it)
/save PATH     save the conversation: PATH.safetensors (KV cache) + PATH.json (transcript)
/load PATH     restore a conversation saved with /save
/quit          exit (Ctrl-D too); Ctrl-C stops a reply"""
STATE_KEY = "mlx_stream_chat"
DEFAULT_SLACK = 64
SENTINEL = "\x00mlx-stream\x00"


@dataclass
class Settings:
    """Per-chat generation settings (what the command line gave)."""

    sinks: int
    window: int
    keep_system: bool = False
    max_tokens: int = opt.DEFAULT_MAX_TOKENS
    temp: float = 0.0
    top_p: float = 1.0
    num_draft_tokens: int = opt.DEFAULT_NUM_DRAFT_TOKENS
    kv_bits: int | None = None
    kv_group_size: int = 64
    kv_key_bits: int | None = None


@dataclass
class Reply:
    """One finished (or interrupted) reply."""

    text: str
    tokens: int
    tps: float
    prompt_tokens: int
    interrupted: bool = False
    finish_reason: str | None = None


def cache_count(caches: list) -> int:
    """Tokens the first cache of ``caches`` has consumed."""
    c = caches[0]
    return int(getattr(c, "tokens_seen", c.offset))


@dataclass
class ChatSession:
    """A conversation: transcript, KV caches and what they hold.

    Attributes:
        messages: The user/assistant turns (the system prompt is kept apart).
        fed_text: The rendered conversation whose tokens are in the caches, apart from
            ``pending``.
        pending: Tokens of ``fed_text`` the caches have not seen yet (the last sampled
            token of a reply is sampled but not fed); fed at the start of the next turn.
    """

    model: Any
    tokenizer: Any
    settings: Settings
    system: str | None = None
    draft_model: Any = None
    messages: list[dict[str, str]] = field(default_factory=list)
    fed_text: str = ""
    pending: list[int] = field(default_factory=list)
    sinks: int = 0
    caches: list = field(default_factory=list)
    n_target: int = 0
    last: Reply | None = None

    def __post_init__(self) -> None:
        self.reset()

    # ----- rendering ----------------------------------------------------------------

    def conversation(self, messages: list[dict[str, str]] | None = None) -> list[dict]:
        """The system prompt (if any) followed by ``messages`` (default: the transcript)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + list(self.messages if messages is None else messages)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """``messages`` through the chat template (plain lines without one)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        return "".join(m["content"] + "\n" for m in messages)

    def encode(self, text: str) -> list[int]:
        """Tokens of rendered text (the template writes any BOS itself)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def system_tokens(self) -> int:
        """Tokens of the rendered system prompt: what ``--keep-system`` makes the sinks.

        Without ``--system``, a template that writes a default system prompt (SmolLM2's
        does) keeps that: everything rendered before the first user message. Returns 0
        when there is no system prompt at all.
        """
        first_turn = [{"role": "user", "content": SENTINEL}]
        full = self.render(self.conversation(first_turn))
        if self.system:
            text = self.render(self.conversation([]), add_generation_prompt=False)
            if full.startswith(text):
                return len(self.encode(text))
        head = full[: full.index(SENTINEL)] if SENTINEL in full else ""
        if not self.system and "system" not in head:
            return 0
        return len(self.encode(head))

    def turn_tokens(self, user_text: str) -> tuple[list[int], str]:
        """Tokens to feed for a new user message, and the rendered conversation after it."""
        messages = self.messages + [{"role": "user", "content": user_text}]
        full = self.render(self.conversation(messages))
        if full.startswith(self.fed_text):
            new = full[len(self.fed_text) :]
        else:
            # The template rewrote earlier turns: render the new message alone.
            new = self.render([{"role": "user", "content": user_text}])
            bos = getattr(self.tokenizer, "bos_token", None)
            if bos and new.startswith(bos):
                new = new[len(bos) :]
        return self.pending + self.encode(new), full

    # ----- engine calls -------------------------------------------------------------

    def make_caches(self) -> list:
        """Fresh SinkCaches for the model (and the draft model after it)."""
        from mlx_stream.cache import make_sink_cache

        s = self.settings
        # Slack must cover a speculative verify block and its rollback.
        slack = max(s.num_draft_tokens + 1, DEFAULT_SLACK)
        kv = {"kv_bits": s.kv_bits, "kv_group_size": s.kv_group_size, "key_bits": s.kv_key_bits}
        caches = make_sink_cache(self.model, self.sinks, s.window, slack, **kv)
        self.n_target = len(caches)
        if self.draft_model is not None:
            caches += make_sink_cache(self.draft_model, self.sinks, s.window, slack, **kv)
        return caches

    def generate(self, tokens: list[int]) -> Iterator[Any]:
        """The engine's streaming generator over ``tokens`` with the session's caches."""
        from mlx_stream.decode import stream_generate

        s = self.settings
        return stream_generate(
            self.model,
            self.tokenizer,
            tokens,
            max_tokens=s.max_tokens,
            sinks=self.sinks,
            window=s.window,
            draft_model=self.draft_model,
            num_draft_tokens=s.num_draft_tokens,
            prompt_cache=self.caches,
            temp=s.temp,
            top_p=s.top_p,
        )

    # ----- conversation -------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation; keep the model, settings and system prompt."""
        self.messages, self.fed_text, self.pending, self.last = [], "", [], None
        self.sinks = self.settings.sinks
        if self.settings.keep_system:
            self.sinks = self.system_tokens()
            if self.sinks == 0:
                fail("--keep-system needs a system prompt: pass --system TEXT")
        self.caches = self.make_caches()

    def set_system(self, text: str | None) -> None:
        """Set the system prompt and start over (the cache holds the old one)."""
        self.system = text or None
        self.reset()

    def reply(self, user_text: str, write: Callable[[str], None]) -> Reply:
        """Stream a reply to ``user_text`` through ``write``; Ctrl-C stops it early.

        The reply, finished or not, joins the transcript and the cache.
        """
        tokens, full = self.turn_tokens(user_text)
        before = [cache_count(self.caches)]
        if self.draft_model is not None:
            before.append(cache_count(self.caches[self.n_target :]))
        generated: list[int] = []
        last = None
        from mlx_stream.decode import StopOnInterrupt

        gen = self.generate(tokens)
        with StopOnInterrupt() as ctrl_c:
            try:
                for response in gen:
                    last = response
                    generated.append(response.token)
                    write(response.text)
                    if ctrl_c.interrupted:
                        break
            finally:
                gen.close()
        finish = getattr(last, "finish_reason", None)
        eos = set(getattr(self.tokenizer, "eos_token_ids", ()) or ())
        if generated and finish == "stop" and generated[-1] in eos:
            generated.pop()
        self._settle(before, len(tokens), generated)
        text = self.tokenizer.decode(generated)
        self.messages += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": text},
        ]
        self.fed_text = full + text
        self.last = Reply(
            text=text,
            tokens=len(generated),
            tps=float(getattr(last, "generation_tps", 0.0) or 0.0),
            prompt_tokens=len(tokens),
            interrupted=ctrl_c.interrupted,
            finish_reason=finish,
        )
        return self.last

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
        from mlx_stream.reclaim import memory_snapshot

        first = self.caches[0]
        seen = cache_count(self.caches)
        mem = memory_snapshot()
        return {
            "turns": len(self.messages) // 2,
            "tokens_seen": seen,
            "sinks": self.sinks,
            "window": self.settings.window,
            "sinks_used": min(seen, self.sinks),
            "window_used": min(max(0, seen - self.sinks), self.settings.window),
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
            "sinks": self.sinks,
            "window": self.settings.window,
            "keep_system": self.settings.keep_system,
        }

    def save(self, path: str | Path) -> tuple[Path, Path]:
        """Save the KV cache and the transcript (each file atomically); with a draft
        model its cache goes to ``PATH.draft.safetensors``."""
        from mlx_stream.cache import save_cache

        cache_path, transcript_path = checkpoint_paths(path)
        draft_path = draft_cache_path(cache_path)
        for p in (cache_path, transcript_path):
            check_output_path(p)
        state = self.state()
        with atomic_path(cache_path) as tmp:
            save_cache(tmp, self.caches[: self.n_target], {STATE_KEY: json.dumps(state)})
        if self.draft_model is not None:
            with atomic_path(draft_path) as tmp:
                save_cache(tmp, self.caches[self.n_target :])
        atomic_write_text(transcript_path, json.dumps(state, indent=2, ensure_ascii=False) + "\n")
        return cache_path, transcript_path

    def load(self, path: str | Path) -> Path:
        """Restore a conversation saved by :meth:`save`."""
        from mlx_stream.cache import load_cache

        cache_path, _ = checkpoint_paths(path)
        draft_path = draft_cache_path(cache_path)
        if not cache_path.is_file():
            fail(f"{cache_path}: no such file")
        if self.draft_model is not None and not draft_path.is_file():
            fail(f"{cache_path}: saved without a draft model (no {draft_path.name})")
        try:
            caches, meta = load_cache(cache_path, self.model)
            state = json.loads(meta[STATE_KEY])
            if self.draft_model is not None:
                caches += load_cache(draft_path, self.draft_model)[0]
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            fail(f"{cache_path}: not a chat saved with /save ({exc})")
        if len(caches) != len(self.caches):
            fail(
                f"{cache_path}: saved for another model ({len(caches)} cache layers, not {len(self.caches)})"
            )
        self.caches = caches
        self.system = state["system"]
        self.messages = state["messages"]
        self.fed_text = state["fed_text"]
        self.pending = list(state["pending"])
        self.sinks = state["sinks"]
        self.settings.window = state["window"]
        self.last = None
        return cache_path


def draft_cache_path(cache_path: Path) -> Path:
    """Where ``/save`` puts the draft model's cache: ``PATH.draft.safetensors``."""
    return cache_path.with_name(cache_path.name.removesuffix(".safetensors") + ".draft.safetensors")


def checkpoint_paths(path: str | Path) -> tuple[Path, Path]:
    """``PATH`` -> (``PATH.safetensors``, ``PATH.json``); a given suffix of either is dropped."""
    path = Path(path).expanduser()
    if path.suffix in (".safetensors", ".json"):
        path = path.with_suffix("")
    return path.with_name(path.name + ".safetensors"), path.with_name(path.name + ".json")


# ---------------------------------------------------------------------------- UI


def stats_line(session: ChatSession) -> str:
    """One dim line: reply tokens, tok/s, cache fill, memory."""
    s = session.stats()
    reply = session.last
    parts = []
    if reply is not None:
        parts.append(f"{reply.tokens} tokens")
        parts.append(f"{reply.tps:.1f} tok/s")
        if reply.interrupted:
            parts.append("stopped")
    parts.append(
        f"cache {s['sinks_used']}+{s['window_used']}/{s['sinks']}+{s['window']}"
        f" ({s['tokens_seen']} seen)"
    )
    parts.append(f"mem {s['active_memory'] / 1e6:.0f} MB (peak {s['peak_memory'] / 1e6:.0f} MB)")
    return " · ".join(parts)


def stats_text(session: ChatSession) -> str:
    """The ``/stats`` report, a few aligned lines."""
    s = session.stats()
    rows = [
        ("turns", s["turns"]),
        ("tokens seen", s["tokens_seen"]),
        (
            "cache",
            f"{s['sinks_used']}/{s['sinks']} sinks + {s['window_used']}/{s['window']} window",
        ),
        ("cache buffers", f"{s['cache_bytes'] / 1e6:.1f} MB"),
        (
            "memory",
            f"active {s['active_memory'] / 1e6:.1f} MB, pool {s['cache_memory'] / 1e6:.1f} MB, "
            f"peak {s['peak_memory'] / 1e6:.1f} MB",
        ),  # fmt: skip
    ]
    if session.last is not None:
        rows.append(("last reply", f"{session.last.tokens} tokens, {session.last.tps:.1f} tok/s"))
    return "\n".join(f"{k:<14} {v}" for k, v in rows)


def handle_command(session: ChatSession, line: str, say: Callable[[str], None]) -> bool:
    """Run a slash command; returns False when the chat should end."""
    name, _, arg = line[1:].partition(" ")
    arg = arg.strip()
    if name in ("quit", "exit", "q"):
        return False
    if name in ("help", "h", "?"):
        say(HELP)
    elif name == "reset":
        session.reset()
        say("Conversation reset.")
    elif name == "stats":
        say(stats_text(session))
    elif name == "system":
        session.set_system(arg)
        say(f"System prompt {'set' if arg else 'cleared'}; conversation reset.")
    elif name in ("save", "load"):
        if not arg:
            fail(f"/{name} needs a path")
        if name == "save":
            cache_path, transcript = session.save(arg)
            say(f"Saved {cache_path} and {transcript}.")
        else:
            cache_path = session.load(arg)
            say(f"Loaded {cache_path} ({len(session.messages) // 2} turns).")
    else:
        fail(f"unknown command /{name} (try /help)")
    return True


def read_line(interactive: bool) -> str:
    """One input line (raises EOFError at the end of input / Ctrl-D)."""
    if interactive:
        return input(PROMPT)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def run(session: ChatSession, interactive: bool, console) -> None:
    """The read-reply loop until /quit or end of input."""
    from mlx_stream.errors import UserError

    def write(text: str) -> None:
        print(text, end="", flush=True)

    def say(text: str) -> None:
        print(text, flush=True)

    while True:
        try:
            line = read_line(interactive).strip()
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            print()
            continue
        if not line:
            continue
        if line.startswith("/"):
            try:
                if not handle_command(session, line, say):
                    return
            except UserError as exc:
                error_line(str(exc))
            continue
        session.reply(line, write)
        print(flush=True)
        if interactive:
            console.print(stats_line(session), style="dim", highlight=False, soft_wrap=True)


@handle_errors
def chat(
    model: opt.Model = None,
    sinks: opt.Sinks = None,
    window: opt.Window = None,
    keep_system: opt.KeepSystem = False,
    system: opt.System = None,
    max_tokens: opt.MaxTokens = opt.DEFAULT_MAX_TOKENS,
    temp: opt.Temp = 0.0,
    top_p: opt.TopP = 1.0,
    seed: opt.Seed = None,
    draft_model: opt.DraftModel = None,
    num_draft_tokens: opt.NumDraftTokens = opt.DEFAULT_NUM_DRAFT_TOKENS,
    dtype: opt.Dtype = "auto",
    kv_bits: opt.KvBits = None,
    kv_group_size: opt.KvGroupSize = 64,
    kv_key_bits: opt.KvKeyBits = None,
    distributed: opt.Distributed = "auto",
) -> None:
    """Chat in the terminal, forever, in fixed memory.

    Each turn feeds only the new message into a sink + window KV cache kept across
    turns. Type /help for commands; Ctrl-C stops a reply, Ctrl-D exits. With stdin
    not a terminal, every input line is a turn and only the replies are printed.
    """
    check_positive(sinks, "--sinks", 0)
    check_positive(window, "--window")
    check_positive(max_tokens, "--max-tokens")
    check_positive(num_draft_tokens, "--num-draft-tokens")
    check_sampling(temp, top_p)
    check_kv_bits(kv_bits, kv_group_size, kv_key_bits)
    from mlx_stream import distributed as dist

    cluster = dist.join(distributed, model)
    interactive = is_interactive() and cluster is None
    from rich.console import Console

    console = Console(highlight=False)
    target, tokenizer, spec = load_model(model, dtype, prepare=dist.preparer(cluster))
    if cluster is not None:  # rank 0 reads the input lines, every rank replies to them
        why = "not available with --distributed (each rank holds part of the cache)"
        sys.stdin = cluster.stream(
            sys.stdin, {"/save": f"/save is {why}", "/load": f"/load is {why}"}
        )
    draft = load_model(draft_model, dtype, what="draft model")[0] if draft_model else None
    sinks, window = sizes(spec, sinks, window)
    if seed is not None:
        import mlx.core as mx

        mx.random.seed(seed)
    settings = Settings(
        sinks=sinks,
        window=window,
        keep_system=keep_system,
        max_tokens=max_tokens,
        temp=temp,
        top_p=top_p,
        num_draft_tokens=num_draft_tokens,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        kv_key_bits=kv_key_bits,
    )
    session = ChatSession(target, tokenizer, settings, system=system, draft_model=draft)
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - arrow keys and history for input()
        console.print(
            f"mlx-stream chat · sinks {session.sinks} + window {settings.window} · "
            "/help for commands, Ctrl-C stops a reply, Ctrl-D exits",
            style="dim",
        )
    run(session, interactive, console)
