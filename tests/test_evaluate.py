"""Streaming perplexity: chunking never changes a token's NLL, segments partition the
stream, a resumed run equals an uninterrupted one, and files tokenize as a whole."""

import math
import random

import mlx.core as mx
import pytest

from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.eval.perplexity import iter_tokens, recompute_perplexity, stream_perplexity
from tests import tiny

SINKS, WINDOW = 4, 32
TOKENS = tiny.random_tokens(400, seed=1)  # > 10 windows: the ring wraps many times


def test_chunked_nll_equals_token_by_token_past_several_wraps(tiny_llama):
    one = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, chunk=1, segment=50)
    chunked = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, chunk=64, segment=50)
    assert chunked.tokens == one.tokens == len(TOKENS) - 1
    for a, b in zip(chunked.segments, one.segments, strict=True):
        assert a["nll"] == pytest.approx(b["nll"], abs=1e-4)
    assert chunked.nll == pytest.approx(one.nll, abs=1e-4)


def test_segments_partition_the_scored_tokens(tiny_llama):
    r = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=64)
    starts = [s["start"] for s in r.segments]
    assert starts == list(range(0, len(TOKENS), 64))
    assert [s["end"] for s in r.segments] == starts[1:] + [len(TOKENS)]
    assert r.segments[0]["tokens"] == 63  # the first token predicts, is never scored
    assert sum(s["tokens"] for s in r.segments) == r.tokens == len(TOKENS) - 1
    weighted = sum(s["nll"] * s["tokens"] for s in r.segments) / r.tokens
    assert weighted == pytest.approx(r.nll, rel=1e-9)


def test_resume_from_checkpoint_gives_the_uninterrupted_totals(tiny_llama, tmp_path):
    whole = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=100)
    path = tmp_path / "eval.safetensors"
    part = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=100, limit_tokens=150,
                             checkpoint=path, checkpoint_every=64)  # fmt: skip
    assert part.position == 150 and part.tokens == 149
    rest = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=100, checkpoint=path,
                             resume=True)  # fmt: skip
    assert rest.tokens == whole.tokens
    # float32 round-off only: a resume that lost the cache or the pending token is off by ~1.
    assert rest.nll == pytest.approx(whole.nll, abs=1e-4)
    for a, b in zip(rest.segments, whole.segments, strict=True):
        assert (a["start"], a["end"], a["tokens"]) == (b["start"], b["end"], b["tokens"])
        assert a["nll"] == pytest.approx(b["nll"], abs=1e-4)


def test_limit_tokens_stops_the_stream(tiny_llama):
    r = stream_perplexity(tiny_llama, iter(TOKENS), SINKS, WINDOW, limit_tokens=100)
    assert (r.position, r.tokens) == (100, 99)


def test_callback_reports_progress_per_call(tiny_llama):
    seen = []
    stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, chunk=16,
                      callback=lambda n, ppl: seen.append((n, ppl)))  # fmt: skip
    done = [n for n, _ in seen]
    assert done == sorted(done) and done[-1] == len(TOKENS)
    assert all(b - a <= 16 for a, b in zip([1] + done, done, strict=False))
    assert all(math.isfinite(ppl) for _, ppl in seen)


def test_one_layer_stride_one_stream_equals_recomputation(tiny_draft):
    # With one layer, stored keys do not depend on evicted context, and with sinks moved
    # at every token the positions are the oracle's: the two must agree.
    cache = make_sink_cache(tiny_draft, SINKS, WINDOW, stride=1)
    streamed = stream_perplexity(tiny_draft, TOKENS[:200], SINKS, WINDOW, prompt_cache=cache)
    oracle = recompute_perplexity(tiny_draft, TOKENS[:200], SINKS, WINDOW)
    assert streamed.nll == pytest.approx(oracle.nll, abs=1e-4)


def test_recomputation_subsample_scores_only_the_given_indices(tiny_llama):
    r = recompute_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, indices=[5, 100, 399])
    assert r.tokens == 3 and math.isfinite(r.nll)


def test_recomputation_equals_one_full_forward_per_token(tiny_llama):
    # The oracle prefills the context then scores its last token: one forward over the
    # whole context (sinks + window, positions from 0) must give the same NLL.
    i = 300
    context = TOKENS[:SINKS] + TOKENS[i - WINDOW : i]
    logits = tiny_llama(mx.array(context)[None])[0, -1].astype(mx.float32)
    expected = (mx.logsumexp(logits) - logits[TOKENS[i]]).item()
    r = recompute_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, indices=[i])
    assert r.nll == pytest.approx(expected, abs=1e-4)


def test_absolute_positions_baseline_differs_once_the_window_slides(tiny_llama):
    cache = stream_perplexity(tiny_llama, TOKENS, SINKS, WINDOW, segment=WINDOW)
    absolute = stream_perplexity(
        tiny_llama, TOKENS, SINKS, WINDOW, segment=WINDOW, positions="absolute"
    )
    # Same until the first eviction, different after.
    assert absolute.segments[0]["nll"] == pytest.approx(cache.segments[0]["nll"], abs=1e-4)
    assert absolute.nll != pytest.approx(cache.nll, abs=1e-3)


def _text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    seps = [" ", " ", " ", "\n", "\n\n", "  ", " \n"]
    return "".join(rng.choice(tiny.VOCAB_WORDS) + rng.choice(seps) for _ in range(n_words))


@pytest.mark.parametrize("block_chars", [16, 97, 1 << 16])
def test_iter_tokens_equals_whole_text_tokenization(tokenizer, tmp_path, block_chars):
    text = _text(3000)
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    tokens = iter_tokens(path, tokenizer, block_chars=block_chars)
    assert list(tokens) == tokenizer.encode(text)


def test_iter_tokens_matches_byte_level_bpe_across_seams(tmp_path):
    from tests.support.bpe import tiny_bpe

    bpe = tiny_bpe()

    class Encoder:
        def encode(self, text, add_special_tokens=True):
            return bpe.encode(text, add_special_tokens=add_special_tokens).ids

    text = _text(3000, seed=1).replace("\n\n", " .\n\n")
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    assert list(iter_tokens(path, Encoder(), block_chars=64)) == Encoder().encode(text)


def test_iter_tokens_reads_an_open_file_lazily(tokenizer, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(_text(2000), encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        tokens = iter_tokens(f, tokenizer, block_chars=64)
        next(tokens)
        assert f.tell() < 200  # one block read, not the file
