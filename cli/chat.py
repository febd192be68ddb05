"""``mlx-stream chat``: a terminal chat that never hits a context limit.

The conversation itself (transcript, incremental template rendering, the SinkCache
kept across turns, checkpoints) is :class:`mlx_stream.generate.session.ChatSession`, shared with
``mlx-stream serve``; this module holds only the terminal loop and its slash commands.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from . import options as opt
from .common import (
    check_output_path,
    check_positive,
    describe,
    error_line,
    fail,
    handle_errors,
    is_interactive,
)
from .groups import Only, grouped

if TYPE_CHECKING:
    from mlx_stream.generate.session import ChatSession

PROMPT = ">>> "
HELP = """\
/help            this help
/reset           forget the conversation (keeps the system prompt)
/stats           tokens, cache fill and memory
/show            the system prompt and the sampling settings
/set NAME VALUE  change a setting: temperature, top_p, top_k, min_p,
                 repetition_penalty, max_tokens, or system (the system prompt)
/system TEXT     set the system prompt and start over (/system alone clears it)
/edit N TEXT     replace turn N's message with TEXT and answer the last message again
                 (the turns between stay: their cache is repaired, not recomputed)
/save PATH       save the conversation: PATH.safetensors (KV cache) + PATH.json
/load PATH       restore a conversation saved with /save
/quit            exit (Ctrl-D too)
On a terminal: a paste is one message; \"\"\" starts a block of lines that ends with
\"\"\", and Esc then Enter starts a new line. Ctrl-C stops a reply."""

# /set NAME: (Settings field, parse, check, what the value must be)
SETTINGS = {
    "temperature": ("temp", float, lambda v: v >= 0, "at least 0 (0: greedy)"),
    "top_p": ("top_p", float, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": ("top_k", int, lambda v: v >= 0, "at least 0 (0: off)"),
    "min_p": ("min_p", float, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "repetition_penalty": ("repetition_penalty", float, lambda v: v > 0, "above 0 (1: off)"),
    "max_tokens": ("max_tokens", int, lambda v: v >= 1, "at least 1"),
}
ALIASES = {"temp": "temperature", "top-p": "top_p", "top-k": "top_k", "min-p": "min_p",
           "repetition-penalty": "repetition_penalty", "max-tokens": "max_tokens"}  # fmt: skip

# ---------------------------------------------------------------------------- UI


def stats_line(session: ChatSession) -> str:
    """One dim line: reply tokens, tok/s, cache fill, memory."""
    s = session.stats()
    reply = session.last
    parts = []
    if reply is not None:
        parts.append(f"prompt {reply.prompt_tokens} tokens at {reply.prompt_tps:.0f} tok/s")
        parts.append(f"reply {reply.tokens} tokens at {reply.tps:.1f} tok/s")
        if reply.interrupted:
            parts.append("stopped")
    parts.append(
        f"cache {s['sinks_used']}+{s['window_used']}/{s['sinks']}+{s['window']}"
        f" ({s['tokens_seen']} seen)"
    )
    parts.append(f"mem {s['active_memory'] / 1e6:.0f} MB (peak {s['peak_memory'] / 1e6:.0f} MB)")
    return " · ".join(parts)


def stats_text(session: ChatSession) -> str:
    """The ``/stats`` report, a few aligned lines (bytes: used of reserved, and where)."""
    from mlx_stream.cache.estimate import cache_usage, human, used_of

    s = session.stats()
    rows = [
        ("turns", s["turns"]),
        ("tokens seen", s["tokens_seen"]),
        (
            "cache",
            f"{s['sinks_used']}/{s['sinks']} sinks + {s['window_used']}/{s['window']} window",
        ),
        ("kv cache", used_of(*cache_usage(session.caches), "device")),
        (
            "memory",
            f"active {s['active_memory'] / 1e6:.1f} MB, pool {s['cache_memory'] / 1e6:.1f} MB, "
            f"peak {s['peak_memory'] / 1e6:.1f} MB (device)",
        ),  # fmt: skip
    ]
    from mlx_stream.recall import tier_of

    tier = tier_of(session.caches)
    if tier is not None:  # device bytes stay flat; the store grows (RAM, then disk)
        u = tier.usage()
        rows.append(("recall region", used_of(None, u["region_bytes"], "device")))
        rows.append(("recall blocks", f"{u['stored_blocks']} stored, {u['recalled_blocks']} recalled, "
                     f"{u['scored_blocks']} scored ({u['refresh_seconds']:.2f} s choosing)"))  # fmt: skip
        rows.append(("recall store", used_of(u["ram_bytes"], u["ram_reserved_bytes"], "RAM")))
        if u["disk_reserved_bytes"]:
            rows.append(("", used_of(u["disk_bytes"], u["disk_reserved_bytes"], "disk")))
        rows.append(("recall index", f"{human(u['index_bytes'])} used (block summaries, "
                                     "in the store above)"))  # fmt: skip
    if session.last is not None:
        last = session.last
        rows.append(("last prompt", f"{last.prompt_tokens} tokens, {last.prompt_tps:.0f} tok/s"))
        rows.append(("last reply", f"{last.tokens} tokens, {last.tps:.1f} tok/s"))
    return "\n".join(f"{k:<14} {v}" for k, v in rows)


def show_text(session: ChatSession, source: str) -> str:
    """The ``/show`` report: the system prompt and the sampling settings."""
    s = session.settings
    penalty = s.repetition_penalty if s.repetition_penalty is not None else 1.0
    rows = [
        ("system", session.system if session.system else "(none: the template's own, if any)"),
        ("temperature", f"{s.temp:g}" + (" (greedy)" if s.temp == 0 else "")),
        ("top_p", f"{s.top_p:g}"),
        ("top_k", f"{s.top_k}" + (" (off)" if s.top_k == 0 else "")),
        ("min_p", f"{s.min_p:g}"),
        ("repetition_penalty", f"{penalty:g}" + (" (off)" if penalty == 1 else "")),
        ("max_tokens", s.max_tokens),
        ("defaults from", source),
    ]
    return "\n".join(f"{k:<19} {v}" for k, v in rows)


def set_setting(session: ChatSession, arg: str) -> str:
    """Apply ``/set NAME VALUE``; returns what to say."""
    name, _, value = arg.partition(" ")
    name, value = ALIASES.get(name, name), value.strip()
    if name == "system":
        session.set_system(value)
        return f"System prompt {'set' if value else 'cleared'}; conversation reset."
    if name not in SETTINGS:
        fail(f"/set {name or 'NAME'}: NAME is one of system, {', '.join(SETTINGS)}")
    field, parse, ok, kind = SETTINGS[name]
    try:
        parsed = parse(value)
    except ValueError:
        fail(f"/set {name} needs a number {kind} (got {value!r})")
    if not ok(parsed):
        fail(f"/set {name} must be {kind} (got {value})")
    if name == "repetition_penalty" and parsed == 1:
        parsed = None
    setattr(session.settings, field, parsed)
    return f"Set {name} to {value}."


def handle_command(
    session: ChatSession, line: str, say: Callable[[str], None], source: str = ""
) -> bool:
    """Run a slash command; returns False when the chat should end (``source``: where
    the sampling defaults came from, for ``/show``)."""
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
    elif name == "show":
        say(show_text(session, source))
    elif name == "set":
        say(set_setting(session, arg))
    elif name == "system":
        session.set_system(arg)
        say(f"System prompt {'set' if arg else 'cleared'}; conversation reset.")
    elif name in ("save", "load"):
        if not arg:
            fail(f"/{name} needs a path")
        if name == "save":
            from mlx_stream.generate.session import checkpoint_paths

            for path in checkpoint_paths(arg):
                check_output_path(path)
            cache_path, transcript = session.save(arg)
            say(f"Saved {cache_path} and {transcript}.")
        else:
            cache_path = session.load(arg)
            say(f"Loaded {cache_path} ({len(session.messages) // 2} turns).")
    else:
        fail(f"unknown command /{name} (try /help)")
    return True


def edit_command(session: ChatSession, arg: str, say: Callable[[str], None]) -> str:
    """``/edit N TEXT``: the session edited (``repair.edit``); returns the message to
    answer again."""
    from mlx_stream.defaults import DEFAULT_REPAIR_TOKENS
    from mlx_stream.generate.repair import edit

    number, _, text = arg.partition(" ")
    if not number.isdigit() or not text.strip():
        fail("/edit needs a turn number and the new message: /edit N TEXT")
    again, done = edit(session, int(number), text.strip(), DEFAULT_REPAIR_TOKENS)
    if isinstance(done, str):
        say(f"Turn {number} edited; the conversation is prefilled again ({done}).")
    else:
        say(f"Turn {number} edited: {done.reused} tokens reused, {done.recomputed} computed again.")
    return again


def read_line(interactive: bool) -> str:
    """One input line, bytes that are not UTF-8 made U+FFFD (raises EOFError at the end
    of input / Ctrl-D). Without a terminal every line is a message."""
    from mlx_stream.generate.session import clean_text

    if interactive:
        return clean_text(input(PROMPT))
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text-only stdin
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return clean_text(line).rstrip("\n")
    raw = stream.readline()
    if not raw:
        raise EOFError
    return raw.decode("utf-8", "replace").rstrip("\r\n")


def make_reader(interactive: bool) -> Callable[[], str]:
    """What reads the next message: the line editor when both ends are a terminal
    (a paste is one message), else :func:`read_line` (a line is one message)."""
    if interactive and is_interactive(sys.stdout):
        from mlx_stream.generate.session import clean_text

        from .line_editor import LineEditor, history_path

        editor = LineEditor(PROMPT, history_path())
        return lambda: clean_text(editor.read())
    return lambda: read_line(interactive)


class PrefillStatus:
    """``processing prompt 1024/3400 tokens · 410 tok/s`` on one terminal line while a
    long prompt goes in, erased before the reply's first token (a
    ``prompt_progress_callback``). Hand-written: rich's live display would redraw over
    the reply streamed under it."""

    MIN_TOKENS = 256  # shorter prompts take well under a second

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.shown = False
        self.tic: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.tic is None or done == 0:
            self.tic = now
        if total < self.MIN_TOKENS or done >= total:
            self.clear()
            return
        line = f"processing prompt {done}/{total} tokens"
        if done and now > self.tic:
            line += f" · {done / (now - self.tic):.0f} tok/s"
        self.out.write(f"\r\x1b[2K\x1b[2m{line}\x1b[0m")
        self.out.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[2K")
            self.out.flush()
            self.shown = False


class PrefillInterrupted(Exception):
    """Ctrl-C while a long prompt went in: the turn is dropped."""


def stream_reply(
    session: ChatSession, text: str, write: Callable[[str], None],
    status: PrefillStatus | None = None, **overrides,
) -> bool:  # fmt: skip
    """Stream the reply to ``text`` through ``write``; returns whether Ctrl-C stopped it.

    Ctrl-C stops it at the next token: what was shown is what the conversation keeps
    (``ChatSession.stream``), and the caller prints ``^C`` after it (the terminal's
    echo is off while a reply streams, see ``line_editor.quiet_keys``). During a long
    prompt (:attr:`PrefillStatus.MIN_TOKENS` or more) it stops after the model call
    under way and drops the turn: the conversation is as it was before ``text``.
    """
    from mlx_stream.generate.decode import StopOnInterrupt

    undo = []  # the state before a long prompt, taken before its first model call

    def progress(done: int, total: int) -> None:
        if done == 0 and total >= PrefillStatus.MIN_TOKENS and not undo:
            undo.append(session.checkpoint())  # a fixed size: one cache
        if undo and ctrl_c.interrupted and done < total:
            raise PrefillInterrupted
        if status is not None:
            status(done, total)

    with StopOnInterrupt() as ctrl_c:
        turn = session.stream(text, **overrides, prompt_progress_callback=progress)
        try:
            for response in turn:
                if status is not None:
                    status.clear()
                write(response.text)  # each token the conversation keeps is shown
                if ctrl_c.interrupted:
                    break
        except PrefillInterrupted:
            session.restore(undo[0])
        finally:
            turn.close()
            if status is not None:
                status.clear()
    return ctrl_c.interrupted


def run(session: ChatSession, interactive: bool, console, per_reply=None, source: str = "") -> None:
    """The read-reply loop until /quit or end of input.

    A failing command or reply ends only itself: one line on stderr, then the prompt
    again with the conversation as it was (a reply cut short keeps what it streamed).
    ``per_reply()`` gives each reply's extra ``stream_generate`` arguments; ``source``
    says where the sampling defaults came from (``/show``).
    """
    from .line_editor import quiet_keys

    def write(text: str) -> None:
        print(text, end="", flush=True)

    def say(text: str) -> None:
        print(text, flush=True)

    read = make_reader(interactive)
    while True:
        try:
            line = read().strip()
        except EOFError:
            if interactive:
                print()
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            print()
            continue
        if not line:
            continue
        stopped = False
        try:
            if line.startswith("/edit ") or line == "/edit":
                line = edit_command(session, line[len("/edit") :].strip(), say)
            elif line.startswith("/"):
                if not handle_command(session, line, say, source):
                    return
                continue
            status = PrefillStatus() if interactive else None
            with quiet_keys() if interactive else contextlib.nullcontext():
                stopped = stream_reply(
                    session, line, write, status, **(per_reply() if per_reply else {})
                )
        except Exception as exc:  # noqa: BLE001 - one operation fails, the chat goes on
            from mlx_stream.distributed import is_peer_lost

            if is_peer_lost(exc):  # a rank died: every rank must stop
                raise
            print(flush=True)
            error_line(describe(exc))
            continue
        print("^C" if stopped and interactive else "", flush=True)
        if interactive:
            console.print(stats_line(session), style="dim", highlight=False, soft_wrap=True)


@handle_errors
@grouped
def chat(
    keep_system: opt.KeepSystem = False,
    system: opt.System = None,
    *,
    reply: Annotated[opt.ReplyOptions, Only("max_tokens", "json_schema")],
    model: opt.ModelOptions,
    cache: opt.CacheOptions,
    sampling: opt.SamplingOptions,
    draft: opt.DraftOptions,
    recall: opt.RecallOptions,
    prefix_store: opt.PrefixStoreOptions,
) -> None:
    """Chat in the terminal, forever, in fixed memory.

    Each turn feeds only the new message into a sink + window KV cache kept across
    turns. Type /help for commands; Ctrl-C stops a reply, Ctrl-D exits. On a
    terminal a paste is one message, and three double quotes start a block of lines. With stdin not
    a terminal, every input line is a message and only the replies are printed.
    Sampling follows the model's generation_config.json, else temperature 0.7,
    top-p 0.9, top-k 40, repetition penalty 1.1; /set changes it. The system prompt's
    prefilled cache goes to the prefix store on disk (--prefix-store): the next chat
    with the same system prompt and model starts from it.
    """
    check_positive(reply.max_tokens, "--max-tokens")
    draft.check()
    sampling.check()
    cache.check()
    if reply.json_schema is not None and draft.draft_model is not None:
        fail("--json-schema is not available with --draft-model")
    recall_policy = recall.spec()
    prefixes = prefix_store.open()
    cluster = model.join()
    if cluster is not None:  # a rank's caches hold its shard only: no shared entries
        prefixes = None
    interactive = is_interactive() and cluster is None
    from rich.console import Console

    console = Console(highlight=False)
    target, tokenizer, _, policy, path = model.load(cache, cluster)
    sample = sampling.sampling(path)
    prefixes = prefixes and prefixes.bind(path)  # entries keyed by the model's folder
    if cluster is not None:  # rank 0 reads the input lines, every rank replies to them
        why = "not available with --distributed (each rank holds part of the cache)"
        sys.stdin = cluster.stream(
            sys.stdin, {"/save": f"/save is {why}", "/load": f"/load is {why}"}
        )
    drafter = draft.load(model.dtype)
    policy = policy.replace(recall=recall_policy)
    from mlx_stream.generate.sampler import seed_random

    seed_random(sampling.seed)  # once: every reply's sampler (make_sampling) draws on from it
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.generate.session import ChatSession, Settings

    settings = Settings(
        cache=policy,
        keep_system=keep_system,
        max_tokens=reply.max_tokens,
        temp=sample.temp,
        top_p=sample.top_p,
        top_k=sample.top_k,
        min_p=sample.min_p,
        repetition_penalty=sample.repetition_penalty,
        num_draft_tokens=draft.num_draft_tokens,
        stop_tokens=end_of_turn_tokens(tokenizer),
    )
    session = ChatSession(
        target, tokenizer, settings, system=system, draft_model=drafter, prefix_store=prefixes
    )
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - arrow keys and history for input()
        console.print(
            f"mlx-stream chat · sinks {session.sinks} + window {policy.window} · "
            "/help for commands, Ctrl-C stops a reply, Ctrl-D exits",
            style="dim",
        )
    per_reply = None
    if reply.json_schema is not None:
        from mlx_stream.serve.structured import Grammars, schema_file_grammar

        grammar, grammars = schema_file_grammar(reply.json_schema), Grammars(tokenizer)

        def per_reply() -> dict:
            return {"logits_processors": [grammars.constraint(grammar)]}

        per_reply()  # a tokenizer llguidance cannot read fails now, not at the first turn
    try:
        run(session, interactive, console, per_reply, sample.source)
    finally:
        session.close()  # a --recall-dir store's files go with the chat
