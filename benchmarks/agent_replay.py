"""An agent session replayed against ``mlx-stream serve`` and ``mlx_lm.server``: the same
turns, edits included, time to first token and prompt tokens per request side by side.

The session is ``repair.py``'s agent-like conversation (~3,500 tokens: three rules naming
a box's code word, six tool results from the books in ``benchmarks/data``, each followed
by a one-line note), sent as an agent sends it: every request carries the whole
transcript so far, ending with a user message, and the transcript's own assistant
messages (not the model's replies) come back in the next request. After the last turn,
each of ``repair.py``'s edits (a tool result shortened, a note rewritten, a rule's code
word changed, at several depths) is sent as its own request: the edited transcript plus
a question. Replies are greedy, ``--max-tokens`` long, streamed (OpenAI chat route).

Per request and server: the kind (``turn`` or the edit's), ``prompt_tokens``, the
tokens the server says it had cached (``prompt_tokens_details.cached_tokens``, where it
reports them) and the time to the first streamed token. One JSON line per server, a
summary with the ratios of total time to first token (turns, edits).

    python benchmarks/agent_replay.py    # appends to benchmarks/results/agent_replay/
    python benchmarks/agent_replay.py --quick     # a smoke test
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common
from repair import conversation, edits
from server import free_port, start

SERVERS = ("mlx-stream", "mlx-lm")


def requests(tokenizer, args) -> list[tuple[str, list[dict]]]:
    """``(kind, messages)`` per request: each turn's transcript, then each edit's (the
    edited transcript and its question)."""
    session = conversation(tokenizer, args.tool_tokens)[:-1]  # ends with the last note
    turns = [("turn", session[: i + 1]) for i, m in enumerate(session) if m["role"] == "user"]
    changed = edits(session)[: 2 if args.quick else None]
    question = [{"role": "user", "content": e["question"]} for e in changed]
    return turns + [(e["kind"], e["messages"] + [q]) for e, q in zip(changed, question)]


def ask(api, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed request: time to first token, prompt and cached tokens."""
    tic = time.perf_counter()
    first, usage = None, None
    stream = api.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter()
    done = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {
        "ttft_s": round((first or done) - tic, 3),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
    }


def replay(kind: str, model_path: str, turns, args) -> dict:
    """Every request of the session, in order, against one server started for it."""
    import openai

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start(kind, model_path, port, Path(tmp) / "memory.txt", args)
        try:
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=1800)  # fmt: skip
            model = "default_model" if kind == "mlx-lm" else api.models.list().data[0].id
            rows = [{"kind": k, **ask(api, model, m, args.max_tokens)} for k, m in turns]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    total = {
        part: round(sum(r["ttft_s"] for r in rows if (r["kind"] == "turn") == (part == "turns")), 2)
        for part in ("turns", "edits")
    }
    return {"server": kind, "ttft_total_s": total, "requests": rows}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--tool-tokens", type=int, default=450)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=4096, help="mlx-stream's window")
    parser.add_argument("--servers", default=",".join(SERVERS))
    args: argparse.Namespace = parser.parse_args(argv)
    if args.quick:
        args.tool_tokens, args.max_tokens = 60, 4
    import openai  # noqa: F401 - imported before any clock starts

    from mlx_stream.models import loader

    folder = Path(args.model)
    model_path = str(folder if folder.is_dir() else loader.model_path(args.model))
    turns = requests(common.load_model(model_path)[1], args)
    records = []
    for kind in args.servers.split(","):
        record = common.base_record(
            "agent_replay", model_path, "float32", tool_tokens=args.tool_tokens,
            max_tokens=args.max_tokens, window=args.window,
            **replay(kind, model_path, turns, args),
        )  # fmt: skip
        records.append(common.emit(record, args.out))
    by = {r["server"]: r for r in records}
    if set(SERVERS) <= set(by):
        ours, theirs = by["mlx-stream"]["ttft_total_s"], by["mlx-lm"]["ttft_total_s"]
        summary = {"bench": "agent_replay", "summary": True}
        for part in ("turns", "edits"):
            summary[f"{part}_ttft_ratio"] = round(theirs[part] / max(ours[part], 1e-9), 2)
        records.append(common.emit(summary, args.out))
    return records


if __name__ == "__main__":
    common.main_guard(main)
