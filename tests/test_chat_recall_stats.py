"""``chat``'s ``/stats`` with ``--recall``: the region (device, fixed) apart from the
store (host memory and disk, growing)."""

from __future__ import annotations

from cli.chat import stats_text
from mlx_stream.cache import CacheSpec
from mlx_stream.generate.session import ChatSession, Settings
from mlx_stream.recall import RecallSpec
from tests import tiny


def test_stats_show_the_recall_region_and_store_apart(tmp_path):
    model, tokenizer = tiny.make_model("llama"), tiny.make_tokenizer()
    spec = RecallSpec(blocks=2, ram_bytes=0, folder=str(tmp_path))
    session = ChatSession(model, tokenizer, Settings(CacheSpec(sinks=2, window=32, recall=spec),
                                                     max_tokens=4))  # fmt: skip
    assert "recall store" in stats_text(session)
    words = " ".join(tiny.VOCAB_WORDS[4:] * 3)
    for _ in range(2):
        list(session.stream(words))
    tier = session.caches[0].hooks
    u = tier.usage()
    lines = {line[:14].strip(): line[15:] for line in stats_text(session).splitlines()}
    assert lines["recall region"] == f"{tier.device_nbytes / 1e6:.1f} MB reserved (device)"
    assert lines["recall blocks"] == (
        f"{tier.stored} stored, {len(tier.selection)} recalled, {tier.scored_blocks} scored "
        f"({u['refresh_seconds']:.2f} s choosing)")  # fmt: skip
    assert 0 < tier.scored_blocks <= tier.stored and u["refresh_seconds"] > 0
    # The store's room is allocated 32 blocks at a time: used and reserved apart, by place.
    assert lines[""] == (f"{u['disk_bytes'] / 1e6:.1f} MB used of "
                         f"{u['disk_reserved_bytes'] / 1e6:.1f} MB reserved (disk)")  # fmt: skip
    assert lines["recall store"] == "0.0 MB used of 0.0 MB reserved (RAM)"  # --recall-ram 0
    assert (
        lines["recall index"] == f"{u['index_bytes'] / 1e6:.1f} MB used (block summaries, "
        "in the store above)"
    )
    assert 0 < tier.stored < 32 and 0 < u["block_bytes"] < tier.store.disk_bytes
    assert u["block_bytes"] * 32 == tier.store.disk_bytes * tier.stored  # one segment each
    assert lines["kv cache"].endswith("reserved (device)") and " used of " in lines["kv cache"]
    plain = ChatSession(model, tokenizer, Settings(CacheSpec(sinks=2, window=32)))
    assert "recall" not in stats_text(plain)


def test_stats_say_the_kv_cache_used_of_reserved():
    from mlx_stream.cache.estimate import cache_usage

    model, tokenizer = tiny.make_model("llama"), tiny.make_tokenizer()
    session = ChatSession(model, tokenizer, Settings(CacheSpec(sinks=2, window=256), max_tokens=4))
    list(session.stream("the sea"))
    used, reserved = cache_usage(session.caches)
    assert 0 < used < reserved / 4  # a few tokens of a 258-slot buffer
    line = next(x for x in stats_text(session).splitlines() if x.startswith("kv cache"))
    assert line.endswith(f"{used / 1e6:.1f} MB used of {reserved / 1e6:.1f} MB reserved (device)")
    words = " ".join(tiny.VOCAB_WORDS[4:] * 12)
    list(session.stream(words))  # past the window: every slot written
    assert cache_usage(session.caches)[0] == reserved
