"""The decode engine: batching never changes greedy tokens, the reclaim schedule fires on
crossings, memory stays flat on a SinkCache, and a stopped generation leaves a cache the
next turn can use."""

import gc
import json
import statistics
import subprocess
import sys
from contextlib import closing

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_stream.cache.reclaim import ReclaimSchedule
from mlx_stream.cache.sink import make_sink_cache
from mlx_stream.cache.spec import CacheSpec
from mlx_stream.errors import UserError
from mlx_stream.generate.decode import (
    DecodeState,
    StopOnInterrupt,
    generate_step,
    stream_generate,
    stream_responses,
)
from tests import tiny
from tests.support.paths import REPO

SINKS, WINDOW, SLACK = 4, 32, 8
PROMPT = tiny.random_tokens(40, seed=3)
LONG = 5 * WINDOW + 8  # generations run well past several wraps of the ring


def sink_cache(model, draft=None, slack=SLACK):
    cache = make_sink_cache(model, SINKS, WINDOW, slack)
    return cache + (make_sink_cache(draft, SINKS, WINDOW, slack) if draft is not None else [])


def greedy(model, cache, prompt=PROMPT, max_tokens=LONG, **kwargs) -> list[int]:
    return [t for t, _, _ in generate_step(prompt, model, cache, max_tokens=max_tokens, **kwargs)]


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama):
    return greedy(tiny_llama, sink_cache(tiny_llama))


def tokens_seen(cache) -> int:
    return cache[0].tokens_seen


# ----- batching never changes the tokens ----------------------------------------------


def test_sink_window_changes_tokens_compared_with_a_full_cache(tiny_llama, plain_tokens):
    # Guards the equality tests below: the window really drops context here.
    assert greedy(tiny_llama, make_prompt_cache(tiny_llama)) != plain_tokens


@pytest.mark.parametrize("num_draft_tokens", [2, 4])
def test_speculative_greedy_equals_plain_greedy_past_the_window(
    tiny_llama, tiny_draft, plain_tokens, num_draft_tokens
):
    state = DecodeState()
    out = greedy(
        tiny_llama, sink_cache(tiny_llama, tiny_draft), draft_model=tiny_draft,
        num_draft_tokens=num_draft_tokens, state=state,
    )  # fmt: skip
    assert out == plain_tokens
    assert state.drafted > state.accepted  # rejections and rollbacks happened


def test_target_as_its_own_draft_equals_plain_greedy(tiny_llama, plain_tokens):
    state = DecodeState()
    out = greedy(
        tiny_llama, sink_cache(tiny_llama, tiny_llama), draft_model=tiny_llama,
        num_draft_tokens=3, state=state,
    )  # fmt: skip
    assert out == plain_tokens
    assert state.accepted > LONG // 2  # most tokens came from accepted drafts


@pytest.mark.parametrize("prefill_step_size", [1, 7, 512])
def test_prefill_step_size_does_not_change_tokens(tiny_llama, prefill_step_size):
    prompt = tiny.random_tokens(3 * WINDOW, seed=5)  # prefill itself wraps the ring
    reference = greedy(tiny_llama, sink_cache(tiny_llama), prompt, max_tokens=40)
    out = greedy(
        tiny_llama, sink_cache(tiny_llama), prompt, max_tokens=40,
        prefill_step_size=prefill_step_size,
    )  # fmt: skip
    assert out == reference


def test_chat_turns_equal_one_prompt_of_the_whole_conversation(tiny_llama):
    turn1, turn2 = tiny.random_tokens(30, seed=6), tiny.random_tokens(25, seed=7)
    cache = sink_cache(tiny_llama)
    reply1 = greedy(tiny_llama, cache, turn1, max_tokens=50)
    reply2 = greedy(tiny_llama, cache, turn2, max_tokens=30)
    whole = greedy(tiny_llama, sink_cache(tiny_llama), turn1 + reply1 + turn2, max_tokens=30)
    assert reply2 == whole


def test_speculative_on_a_wrapped_rotating_cache_refuses(tiny_llama):
    # mlx-lm's ring cannot rewind once it wraps: say so instead of diverging silently.
    cache = [RotatingKVCache(max_size=SINKS + WINDOW, keep=SINKS) for _ in range(4)]
    with pytest.raises(UserError, match="RotatingKVCache"):
        greedy(tiny_llama, cache, draft_model=tiny_llama, num_draft_tokens=2)


# ----- reclaim schedule and memory ----------------------------------------------------


class RecordingSchedule(ReclaimSchedule):
    """Records the pool size right before and right after each reclaim."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools = []

    def step(self, previous, current):
        before = mx.get_cache_memory()
        if not super().step(previous, current):
            return False
        self.pools.append((before, mx.get_cache_memory()))
        return True


def _speculative_on_kv_cache(model, schedule, state):
    """Self-drafting with 2 drafts: nearly every round advances the count by 3."""
    cache = make_prompt_cache(model) + make_prompt_cache(model)
    assert isinstance(cache[0], KVCache)  # grows: freed buffers land in the pool
    greedy(model, cache, PROMPT[:10], max_tokens=600, draft_model=model,
           num_draft_tokens=2, reclaim=schedule, state=state)  # fmt: skip


def test_crossing_rule_reclaims_once_per_multiple_under_speculative_steps(tiny_llama):
    schedule, state = RecordingSchedule(every=32), DecodeState()
    _speculative_on_kv_cache(tiny_llama, schedule, state)
    assert state.accepted > 0.9 * state.drafted  # rounds really advanced by ~3
    count = state.prompt_tokens + state.generated
    assert schedule.reclaims == count // 32 - state.prompt_tokens // 32
    assert all(before > 0 for before, _ in schedule.pools)
    assert all(after == 0 for _, after in schedule.pools)  # the pool is handed back


def test_exact_rule_reclaims_far_less_under_speculative_steps(tiny_llama):
    crossing, exact = RecordingSchedule(every=32), RecordingSchedule(every=32, mode="exact")
    _speculative_on_kv_cache(tiny_llama, crossing, DecodeState())
    _speculative_on_kv_cache(tiny_llama, exact, DecodeState())
    assert exact.reclaims <= crossing.reclaims // 2
    # Each exact reclaim had let the pool fill for longer.
    assert statistics.median(b for b, _ in exact.pools) > statistics.median(
        b for b, _ in crossing.pools
    )


def test_plain_decode_reclaims_on_the_shared_count(tiny_llama):
    schedule = ReclaimSchedule(every=16)
    greedy(tiny_llama, sink_cache(tiny_llama), max_tokens=100, reclaim=schedule,
           prefill_step_size=16)  # fmt: skip
    # One count over prompt chunks and decoded tokens: 40 + 100 tokens.
    assert schedule.reclaims == (len(PROMPT) + 100) // 16


def _active_medians(model, cache, n_tokens):
    """Median active memory over each window-long stretch of a generation."""
    active = []
    for _ in generate_step(PROMPT[:10], model, cache, max_tokens=n_tokens):
        mx.synchronize()  # the step dispatched ahead has finished: compare like with like
        active.append(mx.get_active_memory())
    return [statistics.median(active[i : i + WINDOW]) for i in range(0, n_tokens, WINDOW)]


def test_active_memory_stays_flat_on_a_sink_cache():
    # In a process of its own: MLX's active memory counts the whole process, and arrays
    # that an earlier test module left to the garbage collector are freed at any time.
    code = (
        "import json; from tests import tiny; from tests.test_decode import _active_medians,"
        " sink_cache, WINDOW; m = tiny.make_model('llama');"
        " print(json.dumps(_active_medians(m, sink_cache(m), 20 * WINDOW)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    medians = json.loads(out.stdout.strip().splitlines()[-1])
    # The ring is allocated and full from the third window on. Small transient arrays
    # (masks, a step's scratch) move a tiny model's ~350 KB by up to ~2% between windows,
    # without a trend; a cache that grows adds its KV every window (a full cache: >20%).
    warm = statistics.median(medians[2:])
    assert max(medians[2:]) - min(medians[2:]) <= 0.03 * warm, medians


def test_active_memory_grows_on_a_full_cache(tiny_llama):
    # Growth is measured above what the process already holds (other tests' session
    # fixtures, e.g. the real model, would otherwise dwarf a tiny model's cache).
    gc.collect()
    mx.synchronize()
    held = mx.get_active_memory()
    medians = _active_medians(tiny_llama, make_prompt_cache(tiny_llama), 20 * WINDOW)
    assert medians[-1] - held > 1.2 * (medians[2] - held)


# ----- stopping leaves a consistent cache ----------------------------------------------

STOP_AT = 10  # mid-round for 3-token speculative rounds


def _stopped_then_next_turn(model, draft, stop):
    """Generate STOP_AT tokens, stopping by ``stop``; then greedy-decode a next turn."""
    cache = sink_cache(model, draft)
    kwargs = dict(draft_model=draft, num_draft_tokens=3)
    state = DecodeState()
    if stop == "length":
        first = greedy(model, cache, max_tokens=STOP_AT, state=state, **kwargs)
    else:
        gen = generate_step(PROMPT, model, cache, max_tokens=-1, state=state, **kwargs)
        first = []
        for token, _, _ in gen:
            first.append(token)
            if len(first) == STOP_AT:
                break
        gen.close()
    assert state.consistent
    assert tokens_seen(cache) == len(PROMPT) + STOP_AT
    if draft is not None:
        assert tokens_seen(cache[len(model.layers) :]) == len(PROMPT) + STOP_AT
    second = greedy(model, cache, tiny.random_tokens(12, seed=8), max_tokens=30, **kwargs)
    return first, second


@pytest.mark.parametrize("draft", ["none", "self", "other"])
def test_close_mid_generation_leaves_the_cache_of_a_normal_stop(tiny_llama, tiny_draft, draft):
    draft = {"none": None, "self": tiny_llama, "other": tiny_draft}[draft]
    stopped = _stopped_then_next_turn(tiny_llama, draft, "close")
    assert stopped == _stopped_then_next_turn(tiny_llama, draft, "length")


def test_keyboard_interrupt_in_the_consumer_leaves_a_usable_cache(tiny_llama, tokenizer):
    kwargs = dict(draft_model=tiny_llama, num_draft_tokens=3)
    next_turn = tiny.random_tokens(12, seed=8)
    cache = sink_cache(tiny_llama, tiny_llama)
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with closing(stream_generate(tiny_llama, tokenizer, PROMPT, max_tokens=-1,
                                     prompt_cache=cache, **kwargs)) as gen:  # fmt: skip
            for r in gen:
                seen.append(r.token)
                if len(seen) == STOP_AT:
                    raise KeyboardInterrupt
    interrupted = greedy(tiny_llama, cache, next_turn, max_tokens=30,
                         draft_model=tiny_llama)  # fmt: skip
    reference = sink_cache(tiny_llama, tiny_llama)
    greedy(tiny_llama, reference, max_tokens=STOP_AT, draft_model=tiny_llama)
    assert interrupted == greedy(tiny_llama, reference, next_turn, max_tokens=30,
                                 draft_model=tiny_llama)  # fmt: skip


def test_stop_on_interrupt_turns_sigint_into_a_flag():
    import os
    import signal

    before = signal.getsignal(signal.SIGINT)  # the default, or ignored when run in the background
    with StopOnInterrupt() as ctrl_c:
        os.kill(os.getpid(), signal.SIGINT)
        assert ctrl_c.interrupted
    assert signal.getsignal(signal.SIGINT) is before


# ----- stream_generate ------------------------------------------------------------------


def _no_eos(tokenizer):
    """A generation long enough to see the text: greedy tokens without eos (the
    fixture's tokenizer, made afresh)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(tiny.make_hf_tokenizer(), eos_token_ids=[])


def test_stream_generate_ends_with_length_after_max_tokens(tiny_llama, tokenizer):
    rs = list(stream_generate(tiny_llama, _no_eos(tokenizer), PROMPT, max_tokens=12,
                              prompt_cache=CacheSpec(SINKS, WINDOW)))  # fmt: skip
    assert len(rs) == 12
    assert [r.finish_reason for r in rs] == [None] * 11 + ["length"]
    assert [r.generation_tokens for r in rs] == list(range(1, 13))


def test_stream_generate_text_is_the_decoded_tokens(tiny_llama, tokenizer):
    rs = list(stream_generate(tiny_llama, _no_eos(tokenizer), PROMPT, max_tokens=20,
                              prompt_cache=CacheSpec(SINKS, WINDOW)))  # fmt: skip
    assert "".join(r.text for r in rs) == tokenizer.decode([r.token for r in rs])


def test_stream_generate_stops_on_eos(tiny_llama, tokenizer):
    # This prompt reaches eos (id 1) greedily within a few tokens.
    rs = list(stream_generate(tiny_llama, tokenizer, tiny.random_tokens(20, seed=3),
                              max_tokens=100))  # fmt: skip
    assert rs[-1].token in tokenizer.eos_token_ids
    assert rs[-1].finish_reason == "stop"
    assert all(r.token not in tokenizer.eos_token_ids for r in rs[:-1])


def test_stream_generate_cuts_at_a_stop_string(tiny_llama, tokenizer):
    tok = _no_eos(tokenizer)
    full = list(stream_generate(tiny_llama, tok, PROMPT, max_tokens=30,
                                prompt_cache=CacheSpec(SINKS, WINDOW)))  # fmt: skip
    text = "".join(r.text for r in full)
    stop = tokenizer.decode([full[8].token, full[9].token])
    rs = list(stream_generate(tiny_llama, tok, PROMPT, max_tokens=30,
                              prompt_cache=CacheSpec(SINKS, WINDOW), stop=[stop]))  # fmt: skip
    assert rs[-1].finish_reason == "stop"
    assert "".join(r.text for r in rs) == text[: text.index(stop)]


def test_stream_generate_reports_cache_fill_and_memory(tiny_llama, tokenizer):
    rs = list(stream_generate(tiny_llama, _no_eos(tokenizer), PROMPT[:4], max_tokens=60,
                              prompt_cache=CacheSpec(SINKS, WINDOW)))  # fmt: skip
    assert rs[0].cache_fill == pytest.approx(5 / (SINKS + WINDOW))
    assert rs[-1].cache_fill == 1.0
    assert all(r.active_memory > 0 and r.peak_memory >= r.active_memory for r in rs)


def test_seed_makes_sampling_reproducible(tiny_llama, tokenizer):
    def sample(seed):
        return [r.token for r in stream_responses(
            tiny_llama, _no_eos(tokenizer), PROMPT, max_tokens=20,
            prompt_cache=CacheSpec(SINKS, WINDOW), temp=1.0, seed=seed)]  # fmt: skip

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_repetition_penalty_changes_greedy_tokens(tiny_llama, tokenizer):
    def run(**kw):
        return [r.token for r in stream_responses(
            tiny_llama, _no_eos(tokenizer), PROMPT, max_tokens=40,
            prompt_cache=CacheSpec(SINKS, WINDOW), **kw)]  # fmt: skip

    plain, penalised = run(), run(repetition_penalty=3.0)
    assert plain != penalised
    # Greedy with a penalty through the speculative path means the same thing.
    assert run(repetition_penalty=3.0, draft_model=tiny_llama, num_draft_tokens=2) == penalised


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_as_its_own_draft_equals_plain_greedy(real_model):
    from tests.support.paths import DATA

    model, tokenizer, _ = real_model
    window, n_prompt, n_new = 32, 64, 40  # a stream of 104 tokens > 3 windows
    with open(DATA / "moby_dick.txt", encoding="utf-8") as f:
        prompt = tokenizer.encode(f.read(4000))[:n_prompt]

    def caches():
        return make_sink_cache(model, SINKS, window, SLACK)

    plain = greedy(model, caches(), prompt, max_tokens=n_new)
    spec = greedy(model, caches() + caches(), prompt, max_tokens=n_new, draft_model=model,
                  num_draft_tokens=3)  # fmt: skip
    assert spec == plain
