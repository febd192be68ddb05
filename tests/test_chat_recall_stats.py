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
    tier = session.caches[0].recall
    lines = {line[:14].strip(): line[15:] for line in stats_text(session).splitlines()}
    assert lines["recall region"] == f"{tier.device_nbytes / 1e6:.1f} MB (device, fixed)"
    assert lines["recall store"] == (f"0.0 MB RAM + {tier.store.disk_bytes / 1e6:.1f} MB disk "
                                     f"({tier.stored} blocks)")  # fmt: skip
    assert tier.stored > 0 and tier.store.disk_bytes > 0
    plain = ChatSession(model, tokenizer, Settings(CacheSpec(sinks=2, window=32)))
    assert "recall" not in stats_text(plain)
