"""Whether a model fits before it is fetched: weights under a dtype policy plus the KV
cache at a window, against the memory available; a catalogue config against the real
one. Nothing here reaches the network."""

from __future__ import annotations

import contextlib
import io

from mlx_stream.cache import estimate
from mlx_stream.defaults import DEFAULT_SLACK
from mlx_stream.errors import UserError
from mlx_stream.mlxlm import model_classes


def fit_summary(
    config: dict, weights: int, dtype_bytes: int, sinks: int, window: int, kv: dict | None = None
) -> dict:
    """Weights + the full KV cache at ``sinks + window`` (+ slack) for ``config``
    (``estimate.summary``); ``kv``: the cache's ``kv_bits``, ``kv_group_size`` and
    ``key_bits``. The cache counts 0 when the config has no attention layout the
    estimate knows."""
    try:
        layout = estimate.config_layout(config, dtype_bytes)
        cache = estimate.cache_bytes(layout, sinks, window, DEFAULT_SLACK, **(kv or {}))
    except (KeyError, TypeError, ZeroDivisionError):
        cache = 0
    return estimate.summary(weights, cache)


def shape_config(config: dict) -> dict:
    """``config`` with what a catalogue entry leaves out filled in by shape: a
    longrope's factor lists (ones, rotary dims / 2 of them; their values do not shape
    the model)."""
    config = dict(config)
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("type") == "longrope":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        half = int(head_dim * config.get("partial_rotary_factor", 1.0)) // 2
        config["rope_scaling"] = {"long_factor": [1.0] * half, "short_factor": [1.0] * half,
                                  **scaling}  # fmt: skip
    return config


def model_from_config(config: dict):
    """A model of ``config`` built by mlx-lm, lazily: its parameters have shapes and
    dtypes but no memory until evaluated (sizes without downloading anything)."""
    config = shape_config(config)
    # mlx-lm's own config -> classes (its remapping included; load_model uses it).
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config))


def config_weights(config: dict, policy: str) -> int:
    """Bytes of the weights of a model of ``config`` loaded under ``policy``:
    ``"quantized"`` as mlx-lm's conversion stores a 4-bit model (its own
    ``quantize_model``: group 64, bfloat16 scales and norms, or the config's
    ``quantization``), a float dtype dequantized. Computed from the lazy model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    model = model_from_config(config)
    if policy == "quantized":
        model.set_dtype(mx.bfloat16)
        quant = config.get("quantization") or {}
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight
            quantize_model(model, config, quant.get("group_size", 64), quant.get("bits", 4))
    else:
        model.set_dtype(getattr(mx, policy))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


class DoesNotFit(UserError):
    """The model and its cache need more memory than is available (exit 2)."""


def check_fit(what: str, summary: dict, sinks: int, window: int, policy: str) -> None:
    """One :class:`UserError` line when ``summary`` exceeds the memory available."""
    total, available = summary["total_bytes"], summary["available_bytes"]
    if available is None or total <= available:
        return
    h = estimate.human
    why = " (the CPU backend loads weights as float32)" if policy == "float32" else ""
    raise DoesNotFit(
        f"{what} does not fit: it needs {h(total)} (weights {h(summary['weights_bytes'])}{why} "
        f"+ KV cache {h(summary['kv_cache_bytes'])} at sinks {sinks} + window {window}) but "
        f"only {h(available)} of memory is available: lower --window or choose a smaller model"
    )


def config_mismatches(expected: dict, actual: dict) -> list[str]:
    """``key: expected != actual`` for each key of a catalogue config that the real
    ``config.json`` (its ``text_config`` merged in) contradicts."""
    merged = {**actual, **(actual.get("text_config") or {})}
    out = []
    for key, want in expected.items():
        have = merged.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            bad = {k for k, v in want.items() if have.get(k) != v}
            if bad:
                out.append(f"{key}.{sorted(bad)[0]}: {want[sorted(bad)[0]]!r} != {have.get(sorted(bad)[0])!r}")  # fmt: skip
        elif (
            key != "model_type"
            and have != want
            and not (
                isinstance(want, (int, float)) and isinstance(have, (int, float)) and want == have
            )
        ):
            out.append(f"{key}: {want!r} != {have!r}")
        elif key == "model_type" and want not in (
            actual.get("model_type"),
            merged.get("model_type"),
        ):
            out.append(f"model_type: {want!r} != {actual.get('model_type')!r}")
    return out
