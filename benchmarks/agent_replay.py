"""An agent session replayed against ``mlx-stream serve`` and ``mlx_lm.server``: the same
turns, edits included, time to first token and prompt tokens per request side by side.

The session is ``repair.py``'s agent-like conversation (~3,200 tokens: three rules naming
a box's code word, six tool results from the books in ``benchmarks/data``, each followed
by a one-line note), played as an agent plays it: each user message is sent with the
whole transcript so far, and the model's reply (not the script's note) is the assistant
message the next request carries. Then each of ``repair.py``'s edits (a tool result
shortened, a reply rewritten, a rule's code word changed, at several depths) is applied
to that transcript, cumulatively, and sent with its question. Replies are greedy,
``--max-tokens`` long, streamed (OpenAI chat route).

Per request and server: the kind (``turn`` or the edit's), ``prompt_tokens``, the
tokens the server says it had cached (``prompt_tokens_details.cached_tokens``, where it
reports them), the tokens ``serve`` repaired and reused after an edit, and the time to
the first streamed token. One JSON line per server, a
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


def script(tokenizer, args) -> tuple[list[dict], list[dict]]:
    """The scripted session (alternating user and assistant messages, ending with an
    assistant one) and its edits (``repair.edits``)."""
    session = conversation(tokenizer, args.tool_tokens)[:-1]  # ends with the last note
    return session, edits(session)[: 2 if args.quick else None]


def requests(session: list[dict], changes: list[dict], send) -> list[dict]:
    """Play the session as an agent does: each user message sent with the transcript so
    far, the model's reply kept as the assistant message (the script's is dropped); then
    each edit applied to that transcript (cumulatively: an agent prunes one message after
    another) and sent with its question. ``send(kind, messages)`` returns
    ``(row, reply)``; returns the rows."""
    sent: list[dict] = []
    rows = []
    for m in session:
        if m["role"] == "assistant":
            continue
        row, reply = send("turn", [*sent, m])
        sent += [m, {"role": "assistant", "content": reply}]
        rows.append(row)
    for e in changes:
        sent[e["at"]] = e["messages"][e["at"]]
        question = {"role": "user", "content": e["question"]}
        row, reply = send(e["kind"], [*sent, question])
        sent += [question, {"role": "assistant", "content": reply}]
        rows.append(row)
    return rows


def ask(api, model: str, messages: list[dict], max_tokens: int) -> tuple[dict, str]:
    """One streamed request: time to first token, prompt, cached and repaired tokens;
    and the reply."""
    tic = time.perf_counter()
    first, usage, parts = None, None, []
    stream = api.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        text = "".join(c.delta.content or "" for c in chunk.choices)
        if first is None and text:
            first = time.perf_counter()
        parts.append(text)
    done = time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    row = {
        "ttft_s": round((first or done) - tic, 3),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "cached_tokens": getattr(details, "cached_tokens", None) if details else None,
        "repaired_tokens": getattr(usage, "repaired_tokens", None) if usage else None,
        "reused_tokens": getattr(usage, "reused_tokens", None) if usage else None,
    }
    return row, "".join(parts)


def replay(kind: str, model_path: str, scripted, args) -> dict:
    """Every request of the session, in order, against one server started for it."""
    import openai

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start(kind, model_path, port, Path(tmp) / "memory.txt", args)
        try:
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=1800)  # fmt: skip
            model = "default_model" if kind == "mlx-lm" else api.models.list().data[0].id

            def send(what: str, messages: list[dict]) -> tuple[dict, str]:
                row, reply = ask(api, model, messages, args.max_tokens)
                return {"kind": what, **row}, reply

            rows = requests(*scripted, send)
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
    scripted = script(common.load_model(model_path)[1], args)
    records = []
    for kind in args.servers.split(","):
        record = common.base_record(
            "agent_replay", model_path, "float32", tool_tokens=args.tool_tokens,
            max_tokens=args.max_tokens, window=args.window,
            **replay(kind, model_path, scripted, args),
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
