"""mlx-lm's private and undocumented names, in one place.

mlx-stream runs mlx-lm's models on caches of its own, and leans on a few mlx-lm names
that are private (a leading underscore) or undocumented. Every use of one in the
package, the CLI and the benchmarks goes through this module, and
``tests/test_mlxlm.py`` checks each assumption against the installed mlx-lm: an
upgrade that breaks one fails there, under the assumption's name, and nowhere else.
Each item says what is assumed and the mlx-lm version it was checked with (pyproject
pins ``mlx-lm>=0.32.2,<0.33``).

A base module: it imports nothing from the package. mlx-lm is imported on first use
(``import mlx_lm`` is slow), so importing this module loads neither mlx nor mlx-lm.
The classes and objects (``BaseCache``, ``TextStateMachine``, ``generation_stream``)
resolve on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # resolved on first access at run time (``__getattr__`` below)
    from mlx_lm.generate import TextStateMachine, generation_stream
    from mlx_lm.models.cache import _BaseCache as BaseCache

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_PARAMETERS",
    "BaseCache",
    "ROPE_FREQ_NAMES",
    "TextStateMachine",
    "batch_caches",
    "byte_decoder",
    "generation_stream",
    "hf_tokenizer",
    "model_classes",
    "rope_freqs",
    "takes_quantized_attention",
    "use_quantized_attention",
]

#: The attention function every mlx-lm model module imports by name from
#: ``mlx_lm.models.base`` and calls as ``scaled_dot_product_attention(queries, keys,
#: values, cache=cache, scale=..., mask=...)`` (0.32.2). The package replaces that name
#: in a model's modules with a wrapper (``cache/qattend.py``, ``recall/hook.py``).
ATTENTION_NAME = "scaled_dot_product_attention"

#: Its parameters, in order (``sinks`` defaults to ``None``), as of 0.32.2: the
#: wrappers take exactly these and pass them on by keyword.
ATTENTION_PARAMETERS = ("queries", "keys", "values", "cache", "scale", "mask", "sinks")

#: Attribute names under which rope modules keep their 1-D frequency table (its length
#: is half the dims they turn): mlx-lm's ``rope_utils`` ropes (``SuScaledRoPE``,
#: ``Llama3RoPE``, ``YarnRoPE``, ``ProportionalRoPE``) use the private ``_freqs``, some
#: model files ``_inv_freq``; the public spellings for others (0.32.2).
ROPE_FREQ_NAMES = ("_freqs", "freqs", "inv_freq", "_inv_freq")


def _base_cache() -> type:
    """``mlx_lm.models.cache._BaseCache`` (private, 0.32.2): the base class of all of
    mlx-lm's caches (``KVCache``, ``RotatingKVCache``, ``QuantizedKVCache``...). The
    package's caches subclass it to be taken as prompt-cache entries, and inherit its
    defaults: an empty ``state``, ``is_trimmable() -> False``, ``size() -> 0``."""
    from mlx_lm.models.cache import _BaseCache

    return _BaseCache


def _text_state_machine() -> type:
    """``mlx_lm.generate.TextStateMachine`` (undocumented, 0.32.2): built from
    ``{"normal": [(stop_text, None), ...]}`` or ``None``; ``make_state("normal")``;
    ``step(state, text) -> (state, emittable_text, name)`` holds back text that may
    begin a stop string and gives ``name`` ``None`` once one ended the text;
    ``flush(state) -> (state, held_text, name)`` at the end."""
    from mlx_lm.generate import TextStateMachine

    return TextStateMachine


def _generation_stream() -> Any:
    """``mlx_lm.generate.generation_stream`` (undocumented, 0.32.2): the stream
    mlx-lm's ``generate_step`` evaluates on. Synchronize it before collectives and
    before a thread or process that decoded ends."""
    from mlx_lm.generate import generation_stream

    return generation_stream


_LAZY = {
    "BaseCache": _base_cache,
    "TextStateMachine": _text_state_machine,
    "generation_stream": _generation_stream,
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _LAZY[name]()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def model_classes(config: dict) -> tuple[type, type]:
    """``(Model, ModelArgs)`` for a ``config.json`` dict, with mlx-lm's remapping of
    model types (mistral -> llama): ``mlx_lm.utils._get_classes`` (private, 0.32.2)."""
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper``: its private
    ``_tokenizer`` (0.32.2). Read off any object that has one; one without it is
    returned as it is."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def byte_decoder() -> dict[str, int]:
    """``{character: byte}`` of byte-level BPE vocabularies (GPT-2's table, all 256
    bytes): ``mlx_lm.tokenizer_utils._byte_decoder()`` (private, 0.32.2)."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    return _byte_decoder()


def rope_freqs(rope: Any) -> Any:
    """The 1-D frequency table ``rope`` keeps under one of :data:`ROPE_FREQ_NAMES`
    (an ``mx.array``), or ``None``."""
    import mlx.core as mx

    for name in ROPE_FREQ_NAMES:
        value = getattr(rope, name, None)
        if isinstance(value, mx.array) and value.ndim == 1:
            return value
    return None


def takes_quantized_attention(cache: Any) -> bool:
    """Whether mlx-lm's attention takes its quantized route for ``cache``: it does for
    any cache with a ``bits`` attribute, on ``(packed, scales, biases)`` keys and
    values of ``cache.bits`` and ``cache.group_size`` (``models/base.py``, 0.32.2)."""
    return hasattr(cache, "bits")


def use_quantized_attention(cache: Any, bits: int, group_size: int) -> None:
    """Send ``cache``'s attention to mlx-lm's quantized route (it then hands mlx-lm
    quantized tuples of ``bits`` in groups of ``group_size``)."""
    cache.bits, cache.group_size = bits, group_size


def batch_caches(generator: Any) -> list:
    """The per-layer caches of the rows an ``mlx_lm.generate.BatchGenerator`` is
    decoding: its private ``_generation_batch.prompt_cache`` (0.32.2)."""
    return generator._generation_batch.prompt_cache  # noqa: SLF001 - see the docstring
