"""Batched decode (mlx_stream/cache/batched.py, mlx_stream/generate/batch.py): every row gives
what the same session gives alone on its own SinkCaches (greedy tokens identical,
logits within float tolerance), with rows at different offsets whose wraps, sink moves
and rebases fall at different steps, rows joining and leaving mid-stream, and sessions
whose turns run through a batch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_stream.cache.batched import BatchSinkCache, check_batchable
from mlx_stream.cache.positions import rope_modules
from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.errors import Unsupported
from mlx_stream.generate.batch import Batch
from mlx_stream.generate.decode import generate_step, stream_responses
from tests.tiny import make_model, random_tokens

# Small sizes so a few dozen tokens cross wraps, sink moves (stride 4) and rebases.
SIZES = dict(sinks=4, window=16, slack=4, stride=4)
TOL = 1e-4


def alone(model, prompt, n, caches=None):
    """``[(token, logprobs)]`` of ``n`` greedy tokens on the session's own caches."""
    caches = caches if caches is not None else make_sink_cache(model, **SIZES)
    return [(t, lp) for t, lp, _ in generate_step(prompt, model, caches, max_tokens=n)]


def drain(batch: Batch, rows, got, steps: int = 1):
    for _ in range(steps):
        batch.step()
        for row, out in zip(rows, got, strict=True):
            while row.inbox:
                out.append(row.inbox.popleft())


def assert_same(got, ref):
    assert [t for t, _ in got] == [t for t, _ in ref]
    err = max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(got, ref, strict=True))
    assert err <= TOL, err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rows_at_different_offsets_give_what_each_session_gives_alone(arch):
    model = make_model(arch)
    prompts = [random_tokens(n, seed=i) for i, n in enumerate((5, 37, 70))]
    n = 60
    ref = [alone(model, p, n) for p in prompts]
    batch = Batch(model)
    rows = [batch.add(make_sink_cache(model, **SIZES), p, max_tokens=n) for p in prompts]
    got = [[] for _ in prompts]
    seen = set()
    while any(len(g) < n for g in got):
        drain(batch, rows, got)
        # Stride positions differ per row at the same step: layouts change at different times.
        seen.add(tuple(c.caches[0].tokens_seen % c.caches[0].rebase_every for c in batch.rows))
    assert any(len(set(s)) > 1 for s in seen)
    for g, r in zip(got, ref, strict=True):
        assert_same(g, r)


def test_rows_join_and_leave_mid_stream_and_continue_alone_exactly():
    model = make_model("llama")
    pa, pb, pc = (random_tokens(n, seed=10 + i) for i, n in enumerate((9, 23, 41)))
    ra, rb, rc = alone(model, pa, 70), alone(model, pb, 50), alone(model, pc, 30)
    batch = Batch(model)
    a_caches = make_sink_cache(model, **SIZES)
    a = batch.add(a_caches, pa)
    got_a, got_b, got_c = [], [], []
    drain(batch, [a], [got_a], 12)
    b = batch.add(make_sink_cache(model, **SIZES), pb, max_tokens=50)
    drain(batch, [a, b], [got_a, got_b], 20)
    # A leaves (its row copied out) and goes on alone on its own caches; B is untouched.
    batch.remove(a)
    assert a_caches[0].keys is not None and len(batch.rows) == 1
    # Its caches hold every token it received (the last one fed: pipelined); take
    # that one back and feed it again alone.
    assert a_caches[0].tokens_seen == len(pa) + len(got_a)
    for c in a_caches:
        c.trim(1)
    got_a += alone(model, [got_a[-1][0]], 70 - len(got_a), caches=a_caches)
    c = batch.add(make_sink_cache(model, **SIZES), pc, max_tokens=30)
    while len(got_b) < 50 or len(got_c) < 30:
        drain(batch, [b, c], [got_b, got_c])
    assert_same(got_a, ra)
    assert_same(got_b, rb)
    assert_same(got_c, rc)


def test_memory_per_row_is_the_sessions_own_fixed_size():
    model = make_model("llama")
    single = make_sink_cache(model, **SIZES)
    alone(model, random_tokens(40), 5, caches=single)
    per_session = sum(c.nbytes for c in single)
    batch = Batch(model)
    rows = [batch.add(make_sink_cache(model, **SIZES), random_tokens(6, seed=i)) for i in range(3)]
    got = [[] for _ in rows]
    sizes = []
    for _ in range(4):
        drain(batch, rows, got, 25)
        mx.eval([layer.state for layer in batch.layers])
        sizes.append(sum(layer.nbytes for layer in batch.layers))
    assert sizes == [3 * per_session] * 4


def test_a_session_stream_through_the_batch_equals_it_alone_with_stop_strings_and_seeds():
    """stream_responses on a batch row: same text, same finish; a seeded sampled row
    draws the same tokens whichever rows share its batch."""
    from tests.tiny import make_tokenizer

    model, tok = make_model("llama"), make_tokenizer()
    prompts = [random_tokens(n, seed=20 + i) for i, n in enumerate((8, 30))]

    def run(prompt, **kw):
        caches = make_sink_cache(model, **SIZES)
        out = list(stream_responses(model, tok, prompt, prompt_cache=caches, **kw))
        return "".join(r.text for r in out), out[-1].finish_reason, caches[0].tokens_seen

    ref = [run(p, max_tokens=40) for p in prompts]
    stop = ref[1][0].split()[5]
    ref_stop = run(prompts[1], max_tokens=40, stop=[stop])
    batch = Batch(model)

    def on_batch(prompt, temp=0.0, seed=None, **kw):
        caches = make_sink_cache(model, **SIZES)
        steps = batch.tokens(temp=temp, seed=seed)
        return caches, stream_responses(model, tok, prompt, prompt_cache=caches, steps=steps, **kw)

    c0, g0 = on_batch(prompts[0], max_tokens=40)
    _, g1 = on_batch(prompts[1], max_tokens=40, stop=[stop])
    _, g2 = on_batch(prompts[0], temp=1.0, seed=7, max_tokens=20)
    outs = [[], [], []]
    live = [g0, g1, g2]
    while any(live):
        for i, g in enumerate(live):
            if g is not None:
                r = next(g, None)
                if r is None:
                    live[i] = None
                else:
                    outs[i].append(r)
    text = ["".join(r.text for r in o) for o in outs]
    assert (text[0], outs[0][-1].finish_reason) == ref[0][:2]
    assert (text[1], outs[1][-1].finish_reason) == ref_stop[:2] and ref_stop[1] == "stop"
    # Left the batch: the caches hold the prompt and every yielded token (pipelined: the
    # last one was fed too), but for the last of a row that ran out of max_tokens.
    unfed = 1 if outs[0][-1].finish_reason == "length" else 0
    assert c0[0].tokens_seen == len(prompts[0]) + len(outs[0]) - unfed and not batch.busy
    sampled = [r.token for r in outs[2]]
    _, lone = on_batch(prompts[0], temp=1.0, seed=7, max_tokens=20)
    assert [r.token for r in lone] == sampled
    assert sampled != [r.token for r in outs[0][:20]]  # really sampled, not greedy


def test_quantized_rows_and_unbatchable_models_are_refused_with_a_reason():
    model = make_model("llama")
    batch = Batch(model)
    with pytest.raises(Unsupported, match="kv_bits"):
        batch.add(make_sink_cache(model, sinks=4, window=64, kv_bits=8), [5, 6, 7])
    gemma = make_model("gemma3_text")
    assert "RotatingKVCache" in check_batchable(gemma)
    with pytest.raises(Unsupported, match="not batched"):
        Batch(gemma)
    with pytest.raises(Unsupported, match="one token per row"):
        layer = BatchSinkCache()
        layer.rows = []
        layer.make_mask(2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_rope_modules_take_one_offset_per_row(arch):
    """mx.fast.rope with an array offset (B,): rows at offsets 5 and 900 in one call
    equal two separate calls, for every rope module the tiny models use."""
    model = make_model(arch)
    ropes = rope_modules(model)
    assert ropes
    x = mx.random.normal((2, 2, 1, 16), key=mx.random.key(1))
    for rope in ropes:
        together = rope(x, offset=mx.array([5, 900]))
        apart = mx.concatenate([rope(x[:1], offset=5), rope(x[1:], offset=900)])
        assert mx.abs(together - apart).max().item() < 1e-5
        assert mx.abs(together[1] - rope(x[1:], offset=5)[0]).max().item() > 1e-2


def test_the_model_check_refuses_a_batched_step_that_is_not_exact(monkeypatch):
    """check_batchable compares rows against single sessions on the model itself: a
    batch whose rows all took the first row's rope position is caught."""
    from mlx_stream.cache import batched as batch_cache

    exact, wrong = make_model("llama"), make_model("llama")  # a verdict is kept per model
    assert batch_cache.check_batchable(exact) is None
    monkeypatch.setattr(batch_cache.BatchSinkCache, "offset", property(lambda s: s.rows[0].offset))
    assert "differs from single-session decoding" in batch_cache.check_batchable(wrong)


def test_recall_rows_are_refused_by_the_batched_cache_itself():
    """Issue 35 (5): a row of a cache with a recall tier cannot join a batch (its tier
    serves one sequence and is never called by the batched write): refused in one line
    by the batched cache and by ``Batch.add``, whoever calls them."""
    from mlx_stream.recall import RecallSpec

    model = make_model("llama")
    caches = make_sink_cache(model, **SIZES, recall=RecallSpec(blocks=2, block=4))
    alone(model, random_tokens(10, seed=3), 1, caches=caches)  # no block evicted yet
    with pytest.raises(Unsupported, match="recall") as refused:
        BatchSinkCache().add(caches[0])
    assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(Unsupported, match="recall"):
        Batch(model).add(caches, [5, 6, 7])


def test_a_repetition_penalty_reads_the_same_history_batched_as_alone():
    """Issue 35 (3): logits processors are handed the row's history (its prompt and
    every token it sampled), as a session alone hands them, not its last token only."""
    from tests.tiny import make_tokenizer

    model, tok = make_model("llama"), make_tokenizer()
    prompts = [random_tokens(n, seed=40 + i) for i, n in enumerate((12, 27))]

    def tokens(prompt, steps=None, **kw):
        caches = make_sink_cache(model, **SIZES)
        return stream_responses(model, tok, prompt, prompt_cache=caches, steps=steps, **kw)

    kw = dict(max_tokens=30, repetition_penalty=2.0)
    ref = [[r.token for r in tokens(p, **kw)] for p in prompts]
    assert ref[0] != [r.token for r in tokens(prompts[0], max_tokens=30)]  # it penalises
    batch = Batch(model)
    live = [tokens(p, batch.tokens(), **kw) for p in prompts]
    got = [[], []]
    while any(live):
        for i, g in enumerate(live):
            r = next(g, None) if g is not None else None
            if r is None:
                live[i] = None
            else:
                got[i].append(r.token)
    assert got == ref
