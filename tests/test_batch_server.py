"""The server's scheduler with batching on: concurrent sessions step together in one
batched call per round and reply exactly what they reply decoding alone; where
batching is refused, the stats say why and requests still interleave."""

from __future__ import annotations

import queue

from mlx_stream.cache.spec import CacheSpec
from mlx_stream.generate.session import Settings
from mlx_stream.serve.event_types import Delta, End, Failed

CONVERSATIONS = [
    [{"role": "user", "content": "hello the sea"}],
    [{"role": "system", "content": "you are a captain"}, {"role": "user", "content": "ship"}],
    [{"role": "user", "content": "what is the capital of france " * 6}],  # a longer prefill
]


def run_all(engine, conversations, **kw):
    """Submit every request at once; their texts once all ended, in order."""
    from mlx_stream.serve.engine import Request

    boxes = [queue.Queue() for _ in conversations]
    for box, messages in zip(boxes, conversations, strict=True):
        engine.submit(Request(emit=box.put, messages=messages, **kw))
    texts = []
    for box in boxes:
        parts = []
        while not isinstance(event := box.get(timeout=60), (End, Failed)):
            if isinstance(event, Delta):
                parts.append(event.text)
        assert isinstance(event, End), event
        texts.append(("".join(parts), event.usage["completion_tokens"]))
    return texts


def make_engine(loaded, tmp_path, **kw):
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    settings = Settings(CacheSpec(sinks=2, window=24), max_tokens=40, **kw.pop("settings", {}))
    e = Engine(model, tokenizer, settings, "tiny", state_dir=tmp_path, **kw)
    e.start()
    return e


def test_batched_sessions_reply_what_they_reply_alone_over_two_turns(loaded, tmp_path):
    """Window 24: replies of 40 tokens wrap every session's ring; the second turn
    continues each session from what the batch left in its own caches."""
    results = {}
    for batching in (True, False):
        e = make_engine(loaded, tmp_path / str(batching), batching=batching)
        try:
            first = run_all(e, CONVERSATIONS)
            follow = [
                c + [{"role": "assistant", "content": t}, {"role": "user", "content": "and then"}]
                for c, (t, _) in zip(CONVERSATIONS, first, strict=True)
            ]
            second = run_all(e, follow, max_tokens=30)
            stats = e.call(lambda e=e: (e.publish(), e.stats)[1]).result()
        finally:
            e.stop()
        results[batching] = (first, second, stats["batch"])
    (b1, b2, batch), (a1, a2, alone) = results[True], results[False]
    assert b1 == a1 and b2 == a2
    assert batch["enabled"] and batch["reason"] is None
    tokens = sum(n for _, n in b1 + b2)
    assert 0 < batch["steps"] < tokens  # rows shared steps
    assert not alone["enabled"] and "no-batch" in alone["reason"]


def test_batching_is_refused_with_a_reason_for_quantized_kv_and_a_draft_model(loaded, tmp_path):
    """(The tiny model's head dimension, 16, admits no quantization group size, so the
    decision is checked before any session exists.)"""
    from mlx_stream.serve.engine import Engine

    model, tokenizer = loaded
    quantized = Settings(CacheSpec(sinks=2, window=24, kv_bits=8))
    e = Engine(model, tokenizer, quantized, "tiny", state_dir=tmp_path)
    e.make_batch()
    assert e.current_batch is None and "kv_bits" in e.batch_refusal
    e = Engine(
        model, tokenizer, Settings(CacheSpec(2, 24)), "tiny", state_dir=tmp_path, draft_model=model
    )
    e.make_batch()
    assert e.current_batch is None and "draft model" in e.batch_refusal
    e = Engine(model, tokenizer, Settings(CacheSpec(2, 24)), "tiny", state_dir=tmp_path)
    e.make_batch()
    assert e.current_batch is not None and e.batch_refusal is None


def test_a_served_batch_streams_to_concurrent_clients_and_reports_itself(tiny_model_dir):
    """A real `mlx-stream serve`: three clients at once (streamed and not) get the
    replies one client alone gets; /v1/sessions reports the batch and its steps."""
    import threading

    from tests.support.server import Server, chat

    server = Server(tiny_model_dir, "--sinks", "2", "--window", "32", "--max-tokens", "30")
    try:
        asks = [[{"role": "user", "content": w}] for w in ("hello the sea", "ship", "paris")]
        alone = [chat(server, m).choices[0].message.content for m in asks]
        steps = server.get("/v1/sessions")["batch"]["steps"]
        together = [None] * 3

        def client(i):
            if i == 1:
                parts = chat(server, asks[i], stream=True)
                together[i] = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
            else:
                together[i] = chat(server, asks[i]).choices[0].message.content

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        batch = server.get("/v1/sessions")["batch"]
    finally:
        server.stop()
    assert together == alone
    assert batch["enabled"] and batch["reason"] is None and batch["steps"] > steps


def test_sessions_decoding_in_a_batch_report_their_device_bytes(loaded, tmp_path):
    """While rows decode in the batch their buffers are the batch's: /v1/sessions kept
    reporting 0 device bytes for them (the chat page's plot dropped to 0 each turn)."""
    from mlx_stream.serve.engine import Request

    e = make_engine(loaded, tmp_path, batching=True)
    seen: list[dict[str, int]] = []
    try:
        run_all(e, CONVERSATIONS[:1])  # a first turn: its bytes are known once
        boxes = [queue.Queue() for _ in CONVERSATIONS]
        count = [0]

        def watch(event, box=boxes[0]):
            box.put(event)
            count[0] += isinstance(event, Delta)
            if count[0] == 10:  # mid-reply, on the worker thread: the rows are batched
                e.publish()
                busy = {s["id"]: s["device_bytes"] for s in e.stats["sessions"] if s["busy"]}
                seen.append(busy)

        follow = CONVERSATIONS[0] + [{"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "more"}]  # fmt: skip
        e.submit(Request(emit=watch, messages=follow, max_tokens=30))
        for box, messages in zip(boxes[1:], CONVERSATIONS[1:], strict=True):
            e.submit(Request(emit=box.put, messages=messages, max_tokens=30))
        for box in boxes:
            while not isinstance(box.get(timeout=60), (End, Failed)):
                pass
        stats = e.call(lambda: (e.publish(), e.stats)[1]).result()
    finally:
        e.stop()
    assert stats["batch"]["steps"] > 0 and seen and len(seen[0]) >= 2
    after = {s["id"]: s["device_bytes"] for s in stats["sessions"]}
    assert all(0 < b == after[i] for i, b in seen[0].items()), (seen, after)  # the same bytes
