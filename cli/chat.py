"""``mlx-stream chat``: a terminal chat that never hits a context limit.

The conversation itself (transcript, incremental template rendering, the SinkCache
kept across turns, checkpoints) is :class:`mlx_stream.generate.session.ChatSession`, shared with
``mlx-stream serve``; this module holds only the terminal loop and its slash commands.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from cli import options as opt
from cli.common import (
    check_cache,
    check_output_path,
    check_positive,
    check_sampling,
    describe,
    error_line,
    fail,
    handle_errors,
    is_interactive,
    load_for_cache,
    load_model,
    recall_spec,
)

if TYPE_CHECKING:
    from mlx_stream.generate.session import ChatSession

PROMPT = ">>> "
HELP = """\
/help          this help
/reset         forget the conversation (keeps the system prompt)
/stats         tokens, cache fill and memory
/system TEXT   set the system prompt and start over (/system alone clears it)
/save PATH     save the conversation: PATH.safetensors (KV cache) + PATH.json (transcript)
/load PATH     restore a conversation saved with /save
/quit          exit (Ctrl-D too); Ctrl-C stops a reply"""

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
    from mlx_stream.recall import tier_of

    tier = tier_of(session.caches)
    if tier is not None:  # device bytes stay flat; the store grows (RAM, then disk)
        rows.append(("recall region", f"{tier.device_nbytes / 1e6:.1f} MB (device, fixed)"))
        rows.append(("recall store", f"{tier.store.host_bytes / 1e6:.1f} MB RAM + "
                     f"{tier.store.disk_bytes / 1e6:.1f} MB disk ({tier.stored} blocks)"))  # fmt: skip
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


def read_line(interactive: bool) -> str:
    """One input line, bytes that are not UTF-8 made U+FFFD (raises EOFError at the end
    of input / Ctrl-D)."""
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


def run(session: ChatSession, interactive: bool, console, per_reply=None) -> None:
    """The read-reply loop until /quit or end of input.

    A failing command or reply ends only itself: one line on stderr, then the prompt
    again with the conversation as it was (a reply cut short keeps what it streamed).
    ``per_reply()`` gives each reply's extra ``stream_generate`` arguments.
    """

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
        try:
            if line.startswith("/"):
                if not handle_command(session, line, say):
                    return
                continue
            session.reply(line, write, **(per_reply() if per_reply else {}))
        except Exception as exc:  # noqa: BLE001 - one operation fails, the chat goes on
            from mlx_stream.distributed import is_peer_lost

            if is_peer_lost(exc):  # a rank died: every rank must stop
                raise
            print(flush=True)
            error_line(describe(exc))
            continue
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
    json_schema: opt.JsonSchema = None,
    recall: opt.Recall = False,
    recall_blocks: opt.RecallBlocks = opt.DEFAULT_RECALL_BLOCKS,
    recall_bits: opt.RecallBits = None,
    recall_ram: opt.RecallRam = opt.DEFAULT_RECALL_RAM_MB,
    recall_dir: opt.RecallDir = None,
) -> None:
    """Chat in the terminal, forever, in fixed memory.

    Each turn feeds only the new message into a sink + window KV cache kept across
    turns. Type /help for commands; Ctrl-C stops a reply, Ctrl-D exits. With stdin
    not a terminal, every input line is a turn and only the replies are printed.
    """
    check_positive(max_tokens, "--max-tokens")
    check_positive(num_draft_tokens, "--num-draft-tokens")
    check_sampling(temp, top_p)
    check_cache(sinks, window, kv_bits=kv_bits, kv_group_size=kv_group_size, key_bits=kv_key_bits)
    if json_schema is not None and draft_model is not None:
        fail("--json-schema is not available with --draft-model")
    recall_policy = recall_spec(recall, recall_blocks, recall_bits, recall_ram, recall_dir)
    from mlx_stream import distributed as dist

    cluster = dist.join(distributed, model)
    interactive = is_interactive() and cluster is None
    from rich.console import Console

    console = Console(highlight=False)
    target, tokenizer, spec, cache = load_for_cache(
        model, dtype, sinks, window, prepare=dist.preparer(cluster), kv_bits=kv_bits,
        kv_group_size=kv_group_size, key_bits=kv_key_bits,
    )  # fmt: skip
    if cluster is not None:  # rank 0 reads the input lines, every rank replies to them
        why = "not available with --distributed (each rank holds part of the cache)"
        sys.stdin = cluster.stream(
            sys.stdin, {"/save": f"/save is {why}", "/load": f"/load is {why}"}
        )
    draft = load_model(draft_model, dtype, what="draft model")[0] if draft_model else None
    cache = cache.replace(recall=recall_policy)
    if seed is not None:
        import mlx.core as mx

        mx.random.seed(seed)
    from mlx_stream.generate.session import ChatSession, Settings

    settings = Settings(
        cache=cache,
        keep_system=keep_system,
        max_tokens=max_tokens,
        temp=temp,
        top_p=top_p,
        num_draft_tokens=num_draft_tokens,
    )
    session = ChatSession(target, tokenizer, settings, system=system, draft_model=draft)
    if interactive:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - arrow keys and history for input()
        console.print(
            f"mlx-stream chat · sinks {session.sinks} + window {cache.window} · "
            "/help for commands, Ctrl-C stops a reply, Ctrl-D exits",
            style="dim",
        )
    per_reply = None
    if json_schema is not None:
        from mlx_stream.serve.structured import Grammars, schema_file_grammar

        grammar, grammars = schema_file_grammar(json_schema), Grammars(tokenizer)

        def per_reply() -> dict:
            return {"logits_processors": [grammars.constraint(grammar)]}

        per_reply()  # a tokenizer llguidance cannot read fails now, not at the first turn
    run(session, interactive, console, per_reply)
