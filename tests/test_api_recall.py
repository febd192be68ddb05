"""The Python API's recall: ``from mlx_stream import RecallSpec`` (lazy, no MLX import)
and ``make_sink_cache(model, ..., recall=RecallSpec(...))`` as the README shows it."""

from __future__ import annotations

import subprocess
import sys

from tests import tiny
from tests.support.paths import REPO


def test_recall_spec_is_a_lazy_top_level_name_that_loads_no_mlx():
    code = (
        "import sys; from mlx_stream import RecallSpec; RecallSpec(blocks=2, bits=8); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


def test_make_sink_cache_with_recall_streams_past_the_window():
    from mlx_stream import RecallSpec, make_sink_cache, stream_generate

    model, tokenizer = tiny.make_model("llama"), tiny.make_tokenizer()
    cache = make_sink_cache(model, sinks=4, window=32, recall=RecallSpec(blocks=2))
    prompt = tiny.random_tokens(400, seed=7)
    out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8,
                                            prompt_cache=cache)]  # fmt: skip
    tier = cache[0].hooks
    assert len(out) == 8 and tier is not None and tier.stored >= 4
    assert tier.selection and tier.device_nbytes > 0
