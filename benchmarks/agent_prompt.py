"""An agent's prompt longer than the window on ``serve``: what recall costs and finds.

Codex's real first request (``tests/fixtures/agents/codex_first.json``: ~6k tokens of
instructions and tool definitions) with one more tool planted in the middle of its tool
list, whose description holds a fact (an archive's name). Questions of several phrasings
ask for it. Served by the engine of ``mlx-stream serve`` in this process, one engine per
cache: the window alone, the window with recall, and a window holding the whole prompt
(the reference: what the model knows with all of it in view). One JSON line per question
and cache (``agent-prompt``): answered or not, the prompt's tokens, the first request's
seconds (mostly prefill), decode tokens per second, device and store bytes; then the
same prompt prefilled by mlx-lm's ``KVCache`` for the speed ratio.

    python benchmarks/agent_prompt.py --window 1024 --out benchmarks/results/agent_prompt/agent_prompt.jsonl
"""

from __future__ import annotations

import json
import queue
import tempfile
import time
from pathlib import Path

from common import base_parser, base_record, emit, load_model, main_guard  # noqa: I001

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.generate.session import Settings
from mlx_stream.recall import RecallSpec
from mlx_stream.serve.engine import Engine, Request
from mlx_stream.serve.event_types import Delta, End, Failed
from mlx_stream.serve.responses import function_tools, input_messages

FIXTURE = Path(__file__).parent.parent / "tests" / "fixtures" / "agents" / "codex_first.json"
FACT = "Cobalt Heron"
KEY = "cobalt"  # the fact's rare word, nowhere else in the prompt: a reply cut short still counts
PLANTED = {
    "type": "function",
    "name": "lookup_ticket",
    "description": f"Looks up a support ticket by its number. Every ticket lives in the "
    f"archive named {FACT}; the archive's name is {FACT}.",
    "parameters": {"type": "object", "properties": {"number": {"type": "integer"}},
                   "required": ["number"]},
}  # fmt: skip
QUESTIONS = [
    "Which archive do support tickets live in? Answer with the archive's name only.",
    "What is the name of the archive that the lookup_ticket tool reads tickets from?",
    "The lookup_ticket tool mentions an archive. What is that archive called?",
]


def prompt() -> tuple[list[dict], list[dict]]:
    """The engine messages (without the question) and tools of the planted request."""
    body = json.loads(FIXTURE.read_text())["body"]
    tools = list(body["tools"])
    tools.insert(len(tools) // 2, PLANTED)
    messages = input_messages(body["input"][:-1], set())  # its own question left out
    return messages, function_tools(tools)[0]


def ask(engine: Engine, messages: list[dict], tools: list[dict], max_tokens: int) -> dict:
    box: queue.Queue = queue.Queue()
    tic = time.perf_counter()
    engine.submit(Request(emit=box.put, messages=messages, tools=tools, tool_choice="none",
                          max_tokens=max_tokens, temp=0.0))  # fmt: skip
    parts, first = [], None
    while not isinstance(event := box.get(timeout=3600), (End, Failed)):
        if isinstance(event, Delta):
            first = first or time.perf_counter()
            parts.append(event.text)
    if isinstance(event, Failed):
        raise RuntimeError(f"request failed: {event.error}") from event.error
    end = time.perf_counter()
    usage = event.usage
    decode = usage["completion_tokens"] / (end - first) if first and end > first else 0.0
    return {"text": "".join(parts), "prompt_tokens": usage["prompt_tokens"],
            "seconds": round(end - tic, 2), "ttft_s": round((first or end) - tic, 2),
            "decode_tps": round(decode, 2)}  # fmt: skip


def mlx_lm_prefill_seconds(model, tokens: list[int]) -> float:
    """mlx-lm's KVCache, the same tokens in chunks of 64 (what serve feeds per round)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tic = time.perf_counter()
    for i in range(0, len(tokens), 64):
        model(mx.array(tokens[i : i + 64])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - tic


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--full-window", type=int, default=7168, help="the reference cache")
    parser.add_argument("--recall-blocks", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model, tokenizer, weights = load_model(args.model, args.dtype)
    messages, tools = prompt()
    pin = min(1024, args.window)
    with tempfile.TemporaryDirectory(prefix="agent-prompt-") as tmp:
        caches = {
            "window": CacheSpec(sinks=4, window=args.window),
            "recall": CacheSpec(sinks=4, window=args.window, recall=RecallSpec(
                blocks=args.recall_blocks, ram_bytes=256_000_000, folder=f"{tmp}/store")),
            "full": CacheSpec(sinks=4, window=args.full_window),
        }  # fmt: skip
        for name, cache in caches.items():
            if args.quick and name == "full":
                continue
            engine = Engine(model, tokenizer, Settings(cache, max_tokens=args.max_tokens),
                            "bench", pin=pin if name != "full" else 1024)  # fmt: skip
            engine.start()
            try:
                for q, question in enumerate(QUESTIONS[: 1 if args.quick else None]):
                    asked = [*messages, {"role": "user", "content": question}]
                    got = ask(engine, asked, tools, args.max_tokens)
                    engine.call(engine.publish).result()
                    s = engine.stats["sessions"][-1]
                    emit(base_record(
                        "agent-prompt", args.model, weights, cache=name, window=cache.window,
                        pin=pin, question=q, answered=KEY in got["text"].lower(),
                        device_bytes=s["device_bytes"], store_bytes=s["store_bytes"], **got,
                    ), args.out)  # fmt: skip
            finally:
                engine.stop()
    mlx_lm_line(model, tokenizer, weights, messages, tools, args)


def mlx_lm_line(model, tokenizer, weights, messages, tools, args) -> None:
    """The same prompt (rendered as serve renders it, tools in its system prompt)
    prefilled by mlx-lm's KVCache: the speed reference."""
    from mlx_stream.serve.tools import ToolSet

    asked = [*messages, {"role": "user", "content": QUESTIONS[0]}]
    shown, extra = ToolSet.make(tools, tokenizer).for_template(asked)
    rendered = tokenizer.apply_chat_template(
        shown, tokenize=False, add_generation_prompt=True, **extra
    )
    tokens = tokenizer.encode(rendered, add_special_tokens=False)
    seconds = mlx_lm_prefill_seconds(model, tokens)
    record = base_record("agent-prompt", args.model, weights, cache="mlx-lm KVCache",
                         prompt_tokens=len(tokens), prefill_s=round(seconds, 2))  # fmt: skip
    emit(record, args.out)


if __name__ == "__main__":
    main_guard(main)
