"""What a model's own files say about generating with it: its sampling defaults
(``generation_config.json``) and the tokens that end a turn (its tokenizer and chat
template).

Contract: :func:`sampling_defaults` gives the model's ``generation_config.json``
sampling where it has any (missing fields take transformers' defaults; ``do_sample:
false`` means greedy, values without ``do_sample`` are taken as meant), else :data:`DEFAULT_SAMPLING`; :func:`end_of_turn_tokens` gives
every token id that ends an assistant turn. Both feed
:class:`~mlx_stream.generate.session.Settings`; nothing here samples (mlx-lm's
``make_sampler`` and ``make_logits_processors`` do, in ``decode``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlx_stream.mlxlm import hf_tokenizer

GENERATION_CONFIG = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class Sampling:
    """How tokens are sampled (mlx-lm's ``make_sampler`` / ``make_logits_processors``
    arguments). ``temp`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 are off;
    ``repetition_penalty`` ``None`` (or 1) is off. ``source`` says where the values
    came from."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    source: str = "greedy"

    def replace(self, **changes: Any) -> Sampling:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# For a model whose files give no sampling: greedy decoding loops on small models
# (SmolLM2-135M: "a love that never sleeps," forever), so sample like ollama's
# defaults do, with mlx-lm's repetition penalty over the last 20 tokens.
DEFAULT_SAMPLING = Sampling(
    temp=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, source="mlx-stream default"
)

# transformers' GenerationConfig defaults, for the fields a generation config omits.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": 0.0}


def read_generation_config(folder: str | Path | None) -> dict[str, Any]:
    """The model folder's ``generation_config.json`` as a dict (``{}`` when it has none
    or it is not a JSON object)."""
    if folder is None:
        return {}
    path = Path(folder) / GENERATION_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def from_generation_config(config: dict[str, Any]) -> Sampling | None:
    """The sampling a generation config asks for, or ``None`` when it names none of
    :data:`SAMPLING_KEYS` (many hold only token ids)."""
    given = {k: config[k] for k in SAMPLING_KEYS if isinstance(config.get(k), (int, float))}
    if not given and "do_sample" not in config:
        return None
    penalty = float(given.get("repetition_penalty", 1.0))
    penalty_or_none = penalty if penalty != 1.0 else None
    if config.get("do_sample") is False:
        return Sampling(repetition_penalty=penalty_or_none, source=f"{GENERATION_CONFIG} (greedy)")
    values = {**_HF_DEFAULTS, **given}
    return Sampling(
        temp=float(values["temperature"]),
        top_p=float(values["top_p"]) or 1.0,
        top_k=max(0, int(values["top_k"])),
        min_p=float(values["min_p"]),
        repetition_penalty=penalty_or_none,
        source=GENERATION_CONFIG,
    )


def sampling_defaults(folder: str | Path | None) -> Sampling:
    """The model's sampling defaults: its generation config's, else :data:`DEFAULT_SAMPLING`."""
    return from_generation_config(read_generation_config(folder)) or DEFAULT_SAMPLING


def end_of_turn_tokens(tokenizer: Any) -> tuple[int, ...]:
    """Every token id that ends an assistant turn, sorted.

    The tokenizer's eos ids, and each special token its chat template writes between
    the end of an assistant message and the next message (``<|im_end|>`` and
    ``<|im_start|>`` for ChatML, ``<|eot_id|>`` and ``<|start_header_id|>`` for
    Llama 3): a model that writes one of these has finished its reply, or has begun
    someone else's. Also the padding token and the end-of-text token under its usual
    names (``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``), which a
    tokenizer converted from GGUF may list as neither (SmolLM2's is its unk token).
    For harmony's vocabulary (gpt-oss) ``<|return|>`` and ``<|call|>``, not its glue.
    """
    from mlx_stream.generate.transcript import special_texts

    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    vocab = _vocab(tokenizer)
    glue = _template_glue(tokenizer)
    if "<|channel|>" in vocab and "<|message|>" in vocab:  # harmony (gpt-oss): <|end|>
        glue = "<|return|><|call|>"  # ends a message of the reply, these end the reply
    for special in special_texts(tokenizer) + _END_OF_TEXT:
        if special in vocab and (special in glue or special in _END_OF_TEXT):
            ids.add(vocab[special])
            glue = glue.replace(special, "")
    return tuple(sorted(ids))


_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def _vocab(tokenizer: Any) -> dict[str, int]:
    hf = hf_tokenizer(tokenizer)
    try:
        return dict(hf.get_vocab())
    except (AttributeError, TypeError):
        return {}


def _template_glue(tokenizer: Any) -> str:
    """What the chat template writes after an assistant message's text and before the
    next message's: ``""`` without a template or when it cannot render a turn."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    first, second = "\x00mlx-stream-a\x00", "\x00mlx-stream-b\x00"
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": second},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse any conversation shape
        return ""
    if first not in text or second not in text:
        return ""
    return text[text.index(first) + len(first) : text.index(second)]
