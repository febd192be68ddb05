"""Repair in place after an edit in the middle of a conversation
(``mlx_stream.generate.repair``) against the rebuild ``serve`` does without it.

An agent-like conversation of about 3,500 tokens (the default model's chat template):
three rules naming a box's code word (early, middle, late), six tool results (parts of
the books in ``benchmarks/data``, ~450 tokens each) each followed by a one-line
summary, in a session with serve's cache policy (pinned system prompt, window 4,096:
the conversation fits). Each edit changes one earlier message, then asks a new
question, greedy:

- ``tool_shortened``: a tool result cut to its first fifth (an agent pruning context);
- ``rewritten``: an assistant summary rewritten;
- ``instruction``: a rule's code word changed; the question asks for that code word,
  so the answer depends on the edit (``follows``: the reply names the new word).

Per edit, the rebuild (the system prompt's snapshot restored, then everything after it
prefilled: serve's ``rebuild``) against a repair with each ``K`` (tokens recomputed
after the edit; ``K=0``: the edited span only; ``exact``: the rest of the window) from
the same session: time to first token of the reply (the repair included), whether the
greedy reply equals the rebuild's, and the KL divergence of the first token's
distribution (rebuild || repair). One JSON line per (edit, K) and a summary per K.

    python benchmarks/repair.py --out benchmarks/results/repair/repair.jsonl
"""

from __future__ import annotations

import math
import time

from common import (  # first: it preloads OpenBLAS before mlx.core
    base_parser,
    base_record,
    book_tokens,
    emit,
    load_model,
    main_guard,
)

BOXES = [("red", "ORCHID", "FALCON"), ("blue", "MAPLE", "GRANITE"),
         ("green", "COBALT", "WILLOW")]  # fmt: skip
BOOKS = ["moby_dick", "alice_in_wonderland", "botchan", "paradise_lost", "moby_dick", "botchan"]
SYSTEM = "You are a coding agent. You read files with tools and answer in one short line."
EXACT = 10**6


def rule(color: str, word: str) -> str:
    return f"Remember this rule: the code word for the {color} box is {word}."


def conversation(tokenizer, tool_tokens: int) -> list[dict]:
    """The agent-like transcript, ending with a user message."""
    msgs: list[dict] = []
    rules = {0: 0, 3: 1, 5: 2}  # tool index -> box whose rule comes before it
    for i, book in enumerate(BOOKS):
        if i in rules:
            color, word, _ = BOXES[rules[i]]
            msgs += [{"role": "user", "content": rule(color, word)},
                     {"role": "assistant", "content": "Noted."}]  # fmt: skip
        skip = 2000 * (i + 1) if i >= 4 else 0
        text = tokenizer.decode(book_tokens(tokenizer, tool_tokens + skip, book)[skip:])
        msgs += [
            {"role": "user", "content": f"Read part {i + 1} of {book}.txt"},
            {"role": "assistant", "content": f'read_file("{book}.txt", part={i + 1})'},
            {"role": "user", "content": f"[tool result]\n{text}"},
            {"role": "assistant", "content": f"Part {i + 1} of {book}.txt is read."},
        ]
    return msgs + [{"role": "user", "content": "Summarize what you read in one line."}]


def edits(messages: list[dict], depths=(0, 2, 4), variants: int = 2) -> list[dict]:
    """Each edit: its kind, the edited messages, the question, the word it expects
    (``depths``: which tool results and summaries are edited; ``variants``: new words
    per rule)."""
    tools = [i for i, m in enumerate(messages) if m["content"].startswith("[tool result]")]
    notes = [i for i, m in enumerate(messages) if m["content"].startswith("Part ")]
    out = []
    for j in depths:
        edited = [dict(m) for m in messages]
        text = edited[tools[j]]["content"]
        edited[tools[j]] = {"role": "user", "content": text[: len(text) // 5] + "\n[truncated]"}
        out.append({"kind": "tool_shortened", "at": tools[j], "messages": edited,
                    "question": "Which file did you read last?", "word": None})  # fmt: skip
        edited = [dict(m) for m in messages]
        edited[notes[j]] = {"role": "assistant",
                            "content": "That file had nothing useful; moving on."}  # fmt: skip
        out.append({"kind": "rewritten", "at": notes[j], "messages": edited,
                    "question": "Which file did you read last?", "word": None})  # fmt: skip
    for color, old, new in BOXES:
        at = next(i for i, m in enumerate(messages) if m["content"] == rule(color, old))
        for word in (new, new.capitalize())[:variants]:
            edited = [dict(m) for m in messages]
            edited[at] = {"role": "user", "content": rule(color, word)}
            question = f"What is the code word for the {color} box? Answer with the word only."
            out.append({"kind": "instruction", "at": at, "messages": edited,
                        "question": question, "word": (word, old)})  # fmt: skip
    return out


def answer(session, question: str, max_tokens: int) -> tuple[float, list[int], str, object]:
    """Time to first token, greedy tokens, text and the first token's logprobs."""
    import mlx.core as mx

    tic = time.perf_counter()
    ttft, tokens, texts, first = None, [], [], None
    turn = session.stream(question, max_tokens=max_tokens)
    try:
        for r in turn:
            if ttft is None:
                ttft, first = time.perf_counter() - tic, mx.array(r.logprobs)
            tokens.append(r.token)
            texts.append(r.text)
    finally:
        turn.close()
    return ttft, tokens, "".join(texts), first


def kl(p_log, q_log) -> float:
    import mlx.core as mx

    p = mx.exp(p_log)
    return max(0.0, float(mx.sum(p * (p_log - q_log)).item()))


def follows(text: str, word: tuple | None) -> bool | None:
    if word is None:
        return None
    new, old = word
    return new.lower() in text.lower() and old.lower() not in text.lower()


def main(argv: list[str] | None = None) -> None:
    from mlx_stream.cache.spec import CacheSpec
    from mlx_stream.generate.model_config import end_of_turn_tokens
    from mlx_stream.generate.repair import repair
    from mlx_stream.generate.session import ChatSession, Settings, cache_count

    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--tool-tokens", type=int, default=450)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ks", default="0,16,32,64,128,exact")
    parser.add_argument("--depths", default="0,2,4", help="tool results edited (0-5)")
    parser.add_argument("--variants", type=int, default=2, help="new code words per rule")
    args = parser.parse_args(argv)
    ks = [EXACT if k == "exact" else int(k) for k in args.ks.split(",")]
    model, tokenizer, weights = load_model(args.model, args.dtype)
    settings = Settings(CacheSpec(sinks=4, window=args.window), keep_system=True,
                        pin_limit=1024, max_tokens=args.max_tokens, temp=0.0,
                        stop_tokens=end_of_turn_tokens(tokenizer))  # fmt: skip
    s = ChatSession(model, tokenizer, settings, system=SYSTEM)
    s.prefill(s.system_text())
    snapshot = s.checkpoint()  # serve's shared system-prompt snapshot
    if args.quick:
        args.tool_tokens = min(args.tool_tokens, 40)
    messages = conversation(tokenizer, args.tool_tokens)
    s.messages = messages[:-1]
    s.reply(messages[-1]["content"], lambda t: None, max_tokens=8)
    base = s.checkpoint()
    total = cache_count(s.caches)
    depths = [int(d) for d in args.depths.split(",")]
    cases = edits(s.messages, depths, args.variants)
    if args.quick:
        cases, ks = cases[::6], ks[:2]
    rows: dict[int, list] = {k: [] for k in ks}
    records = []
    for case in cases:
        history, question = case["messages"], case["question"]
        s.restore(snapshot)
        s.messages = [dict(m) for m in history]
        ref_ttft, ref_tokens, ref_text, ref_first = answer(s, question, args.max_tokens)
        depth = len(s.encode(s.render(s.conversation(history[: case["at"]]), False)))
        for k in ks:
            s.restore(base)
            tic = time.perf_counter()
            done = repair(s, history, question, k)
            repair_s = time.perf_counter() - tic
            if isinstance(done, str):
                raise SystemExit(f"repair refused: {done}")
            ttft, tokens, text, first = answer(s, question, args.max_tokens)
            ttft += repair_s
            row = {"kind": case["kind"], "depth_tokens": depth, "k": "exact" if k == EXACT else k,
                   "conversation_tokens": total, "rebuild_ttft_s": round(ref_ttft, 4),
                   "repair_ttft_s": round(ttft, 4), "repair_s": round(repair_s, 4),
                   "speedup": round(ref_ttft / ttft, 2), "recomputed": done.recomputed,
                   "reused": done.reused, "same_reply": tokens == ref_tokens,
                   "first_token_kl": kl(ref_first, first),
                   "follows": follows(text, case["word"]),
                   "rebuild_follows": follows(ref_text, case["word"]),
                   "reply": text, "rebuild_reply": ref_text}  # fmt: skip
            rows[k].append(row)
            records.append(emit(base_record("repair", args.model, weights, **row), args.out))
    for k, got in rows.items():
        records.append(summary(args, weights, k, got, total))
    return records


def summary(args, weights: str, k: int, got: list[dict], total: int) -> dict:
    """The line of one ``K`` over every edit (the instruction edits' ``follows``)."""
    instr = [r for r in got if r["follows"] is not None]
    kinds = sorted({r["kind"] for r in got})
    return emit(base_record(
        "repair-summary", args.model, weights, k="exact" if k == EXACT else k,
        edits=len(got), window=args.window, conversation_tokens=total,
        median_speedup=sorted(r["speedup"] for r in got)[len(got) // 2],
        min_speedup=min(r["speedup"] for r in got),
        same_reply=sum(r["same_reply"] for r in got) / len(got),
        first_token_kl={kd: mean([r["first_token_kl"] for r in got if r["kind"] == kd])
                        for kd in kinds},
        follows=sum(bool(r["follows"]) for r in instr) / max(1, len(instr)),
        rebuild_follows=sum(bool(r["rebuild_follows"]) for r in instr) / max(1, len(instr)),
    ), args.out)  # fmt: skip


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


if __name__ == "__main__":
    main_guard(main)
