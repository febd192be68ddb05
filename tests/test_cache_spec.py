"""CacheSpec (issue 28): one frozen value for a cache policy, checked once, with its
exact bytes, its JSON form and the prompt cache it builds; checkpoints written before
it existed still load."""

import dataclasses
import json
import re

import mlx.core as mx
import pytest

from mlx_stream import checkpoint as ckpt
from mlx_stream.cache.sink import SinkCache, load_cache, make_sink_cache, save_cache
from mlx_stream.cache.spec import CacheSettingError, CacheSpec
from mlx_stream.errors import UserError
from mlx_stream.eval.perplexity import stream_perplexity
from tests import tiny

TOKENS = tiny.random_tokens(300, seed=3)


@pytest.mark.parametrize(
    "changes, field_message, flag_message",
    [
        ({"window": 0}, "window must be at least 1 (got 0)", "--window must be at least 1"),
        ({"sinks": -1}, "sinks must be 0 or more (got -1)", "--sinks must be 0 or more"),
        ({"positions": "relative"}, "positions must be one of cache, absolute (got 'relative')",
         "--positions must be one of cache, absolute"),
        ({"kv_bits": 3}, "kv_bits must be 4 or 8 (got 3)", "--kv-bits must be 4 or 8 (got 3)"),
        ({"key_bits": 8}, "key_bits must be 4 or 8, with kv_bits set (got 8)",
         "--kv-key-bits must be 4 or 8, with --kv-bits set (got 8)"),
        ({"kv_bits": 4, "kv_group_size": 48}, "kv_group_size must be 32, 64 or 128 (got 48)",
         "--kv-group-size must be 32, 64 or 128 (got 48)"),
    ],
)  # fmt: skip
def test_one_check_names_the_field_or_the_flag(changes, field_message, flag_message):
    with pytest.raises(CacheSettingError) as field:
        CacheSpec(**changes)
    assert str(field.value) == field_message
    assert isinstance(field.value, UserError) and isinstance(field.value, ValueError)
    assert field.value.exit_code == 2
    with pytest.raises(CacheSettingError, match="^" + re.escape(flag_message)):
        CacheSpec.for_model(None, **changes)
    # The sizes without flags are named as fields wherever they come from.
    with pytest.raises(CacheSettingError, match="^slack must be 0 or more .got -1.$"):
        CacheSpec(slack=-1)
    with pytest.raises(CacheSettingError, match="^stride must be at least 1"):
        CacheSpec().replace(stride=0)


def test_defaults_and_the_slack_rule():
    spec = CacheSpec()
    assert (spec.sinks, spec.window, spec.slack, spec.stride) == (4, 1024, 0, 64)
    assert CacheSpec(stride=16).slack == 0  # slack serves rollback only: none by default
    assert spec.for_draft(3).slack == 4  # the rollback of a verify block of 4 tokens
    assert spec.for_draft(100).slack == 101  # a verify block of 101 tokens and its rollback
    assert CacheSpec(slack=64).for_draft(3).slack == 64  # never less than it had
    assert CacheSpec(kv_bits=8) == CacheSpec(kv_bits=8, key_bits=8)  # one spelling
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.window = 8  # type: ignore[misc]


def test_for_model_takes_the_registry_entry_under_the_options():
    entry = dataclasses.make_dataclass("Entry", ["sinks", "window"])(2, 512)
    assert (CacheSpec.for_model(entry).sinks, CacheSpec.for_model(entry).window) == (2, 512)
    assert CacheSpec.for_model(entry, window=64).window == 64
    assert CacheSpec.for_model(None).window == 1024
    assert CacheSpec.for_model(entry, num_draft_tokens=80).slack == 81


def test_json_round_trip_and_cache_file_meta():
    spec = CacheSpec(2, 48, 8, 4, "absolute", 4, 32, 8)
    data = json.loads(json.dumps(spec.to_json()))
    assert data == {"sinks": 2, "window": 48, "slack": 8, "stride": 4, "positions": "absolute",
                    "kv_bits": 4, "kv_group_size": 32, "key_bits": 8}  # fmt: skip
    assert CacheSpec.from_json(data) == spec
    # A SinkCache's meta_state is the same form (plus its position in the stream).
    cache = SinkCache(CacheSpec(2, 48, 8, 4, positions="absolute", kv_bits=4, kv_group_size=32, key_bits=8))
    assert CacheSpec.of(cache) == spec and CacheSpec.from_json(cache.meta_state) == spec
    # Files from before quantization lack its three settings.
    old = {k: v for k, v in data.items() if k not in ("kv_bits", "kv_group_size", "key_bits")}
    assert CacheSpec.from_json(old) == CacheSpec(2, 48, 8, 4, "absolute")
    with pytest.raises(UserError, match="cache setting 'window' must be an integer"):
        CacheSpec.from_json({**data, "window": "48"})
    with pytest.raises(UserError, match="not a cache policy"):
        CacheSpec.from_json([2, 48])


@pytest.mark.parametrize(
    "options",
    [{}, {"positions": "absolute"}, {"kv_bits": 4, "kv_group_size": 32},
     {"kv_bits": 4, "key_bits": 8, "kv_group_size": 32}, {"sinks": 0, "slack": 16, "stride": 8}],
)  # fmt: skip
def test_bytes_equal_the_allocated_cache(options):
    model = tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1)
    spec = CacheSpec(**{"sinks": 4, "window": 40, **options})
    caches = spec.build(model)
    model(mx.array([TOKENS[:8]]), cache=caches)  # the one allocation, at the first update
    mx.eval([c.state for c in caches])
    assert spec.bytes(model) == sum(c.nbytes for c in caches) > 0


def test_build_equals_make_sink_cache():
    tiny_llama = tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1)
    spec = CacheSpec(2, 16, 8, 4, kv_bits=8, kv_group_size=32)
    built = spec.build(tiny_llama)
    shorthand = make_sink_cache(tiny_llama, sinks=2, window=16, slack=8, stride=4, kv_bits=8,
                                kv_group_size=32)  # fmt: skip
    assert [c.meta_state for c in built] == [c.meta_state for c in shorthand]
    assert all(CacheSpec.of(c) == spec for c in built + shorthand)
    for token in TOKENS[:40]:  # past the first eviction, sink moves and rebases
        x = mx.array([[token]])
        assert mx.array_equal(tiny_llama(x, cache=built), tiny_llama(x, cache=shorthand))
    assert [c.meta_state for c in built] == [c.meta_state for c in shorthand]


def test_build_refuses_a_cache_larger_than_memory(tiny_llama):
    with pytest.raises(UserError, match="needs .* TB"):
        CacheSpec(window=10**12).build(tiny_llama)
    with pytest.raises(UserError, match="--kv-group-size 32 does not divide .* 16"):
        CacheSpec(kv_bits=4, kv_group_size=32).build(tiny_llama)  # head_dim 16


def _rewrite_header(path, change):
    arrays, header = mx.load(str(path), format="safetensors", return_metadata=True)
    change(header)
    mx.save_safetensors(str(path), arrays, header)


def test_a_checkpoint_written_before_cache_spec_still_loads(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    spec = CacheSpec(4, 32)
    identity = {"model": "tiny", "dtype": "float32", **spec.to_json()}
    kwargs = {"segment": 100, "checkpoint": path, "cache_spec": spec}
    stream_perplexity(tiny_llama, TOKENS, **kwargs, identity=identity, limit_tokens=150)

    def old_format(header):
        # stream-run's identity before CacheSpec, and cache meta from before kv_bits.
        saved = json.loads(header[ckpt.IDENTITY_KEY])
        for key in spec.to_json():
            saved.pop(key)
        saved.update({"sinks": 4, "window": 32, "positions": "cache", "kv-bits": None,
                      "kv-key-bits": None, "kv-group-size": None})  # fmt: skip
        header[ckpt.IDENTITY_KEY] = json.dumps(saved, sort_keys=True)
        layers = json.loads(header["mlx_stream"])
        for layer in layers["layers"]:
            for key in ("kv_bits", "kv_group_size", "key_bits"):
                layer["meta"].pop(key)
        header["mlx_stream"] = json.dumps(layers)

    _rewrite_header(path, old_format)
    # Read in today's form: the cache settings as the cache file holds them.
    assert ckpt.read_metadata(path)["identity"] == {**identity, "segment": 100,
        ckpt.TEXT_FIELD: ckpt.read_metadata(path)["identity"][ckpt.TEXT_FIELD]}  # fmt: skip
    resumed = stream_perplexity(tiny_llama, TOKENS, **kwargs, identity=identity, resume=True)
    straight = stream_perplexity(tiny_llama, TOKENS, segment=100, cache_spec=spec)
    assert resumed.tokens == straight.tokens == len(TOKENS) - 1
    assert resumed.nll == pytest.approx(straight.nll, rel=1e-5)
    caches, _ = load_cache(path, tiny_llama)
    assert all(CacheSpec.of(c) == spec for c in caches)
    # Another window is still told apart from the old identity.
    with pytest.raises(UserError, match="made with window 32, this run has window 64"):
        other = {**identity, **spec.replace(window=64).to_json()}
        stream_perplexity(tiny_llama, TOKENS, **kwargs, identity=other, resume=True)


def test_save_and_load_carry_the_spec(tmp_path):
    tiny_llama = tiny.make_model("llama", num_attention_heads=2, num_key_value_heads=1)
    spec = CacheSpec(2, 24, 8, 4, "cache", 4, 32, 8)
    caches = spec.build(tiny_llama)
    tiny_llama(mx.array([TOKENS[:30]]), cache=caches)
    save_cache(tmp_path / "s.safetensors", caches)
    loaded, _ = load_cache(tmp_path / "s.safetensors", tiny_llama)
    assert [CacheSpec.of(c) for c in loaded] == [spec] * len(loaded)


def test_stream_run_resumes_a_checkpoint_of_the_old_format(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app
    from tests.support.cli import assert_one_line_error

    text = tmp_path / "book.txt"
    words = [tiny.VOCAB_WORDS[i % len(tiny.VOCAB_WORDS)] for i in range(0, 2100, 7)]
    text.write_text(" ".join(words) + "\n", encoding="utf-8")
    runner, path = CliRunner(), tmp_path / "run.safetensors"
    args = ["stream-run", str(text), "-m", str(tiny_model_dir), "--window", "32", "--sinks", "4",
            "--segment", "100", "--json"]  # fmt: skip
    whole = runner.invoke(app, [*args, "--limit-tokens", "250"])
    first = runner.invoke(app, [*args, "--limit-tokens", "120", "--checkpoint", str(path)])
    assert whole.exit_code == first.exit_code == 0, first.stderr
    assert json.loads(whole.stdout)["cache"] == CacheSpec(4, 32).to_json()

    def old_format(header):  # what stream-run wrote before CacheSpec
        saved = json.loads(header[ckpt.IDENTITY_KEY])
        for key in ("slack", "stride", "kv_bits", "kv_group_size", "key_bits"):
            saved.pop(key)
        saved.update({"kv-bits": None, "kv-key-bits": None, "kv-group-size": None})
        header[ckpt.IDENTITY_KEY] = json.dumps(saved, sort_keys=True)

    _rewrite_header(path, old_format)
    wrong = runner.invoke(app, [*args, "--limit-tokens", "250", "--resume", str(path),
                                "--kv-bits", "8"])  # fmt: skip
    assert_one_line_error(wrong, 2, "made with kv-bits none, this run has kv-bits 8")
    rest = runner.invoke(app, [*args, "--limit-tokens", "250", "--resume", str(path)])
    assert rest.exit_code == 0, rest.stderr
    ours, theirs = json.loads(rest.stdout), json.loads(whole.stdout)
    assert ours["tokens"] == theirs["tokens"] == 249
    assert ours["perplexity"] == pytest.approx(theirs["perplexity"], rel=1e-5)


def test_session_settings_hold_the_policy_apart_from_sampling():
    from mlx_stream.generate.session import Settings

    settings = Settings(CacheSpec(2, 48), max_tokens=6, num_draft_tokens=80)
    assert settings.cache_spec() == CacheSpec(2, 48, slack=81)  # a verify block of 81
    assert settings.cache_spec(sinks=9) == CacheSpec(9, 48, slack=81)  # a pinned system prompt
    assert Settings(CacheSpec(2, 48)).cache_spec() == CacheSpec(2, 48, slack=4)  # 3 drafts
    # Without a draft model a session's caches keep no slack (no masked slot per step).
    assert Settings(CacheSpec(2, 48)).cache_spec(drafting=False) == CacheSpec(2, 48)


def test_served_sessions_report_their_policy(tiny_model_dir, tmp_path):
    import queue

    from mlx_stream.generate.session import Settings
    from mlx_stream.models.loader import load
    from mlx_stream.serve.engine import Engine, Request
    from mlx_stream.serve.event_types import End, Failed

    model, tokenizer = load(str(tiny_model_dir))
    e = Engine(model, tokenizer, Settings(CacheSpec(2, 24), max_tokens=4), "tiny",
               state_dir=tmp_path)  # fmt: skip
    e.start()
    try:
        box = queue.Queue()
        messages = [{"role": "system", "content": "you are a captain"},
                    {"role": "user", "content": "the sea"}]  # fmt: skip
        e.submit(Request(emit=box.put, messages=messages))
        while not isinstance(event := box.get(timeout=60), (End, Failed)):
            pass
        assert isinstance(event, End), event
        stats = e.call(lambda: (e.publish(), e.stats)[1]).result()
    finally:
        e.stop()
    (session,) = stats["sessions"]
    assert session["sinks"] > 2  # the pinned system prompt is the sinks
    assert session["cache"] == CacheSpec(session["sinks"], 24).to_json()
