"""Per-token log probabilities in OpenAI's shape, for ``serve``'s ``logprobs``.

The decode loop already has each step's normalized log probabilities (``logits -
logsumexp(logits)``, before temperature and top-p, as mlx-lm's server reports them);
this module names the chosen token and the ``top`` most likely ones. A token's text
and bytes come from mlx-lm's own detokenizer token map (the GPT-2 byte map for BPE,
``<0xNN>`` byte tokens and the ``▁`` space for SentencePiece), since a tokenizer's
``decode([id])`` drops a leading space and splits multi-byte characters.
"""

from __future__ import annotations

from typing import Any

MAX_TOP = 20  # OpenAI's bound on top_logprobs
FLOOR = -9999.0  # what a -inf log probability reads as in JSON (which has no -inf)


class TokenLogprobs:
    """Turns ``(token, logprobs)`` of one decode step into OpenAI's entry."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._bytes: list[bytes] | None = None

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` adds to the text."""
        if self._bytes is None:
            self._bytes = self._table()
        if 0 <= token < len(self._bytes):
            return self._bytes[token]
        return self.tokenizer.decode([token]).encode("utf-8")

    def _table(self) -> list[bytes]:
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

        from mlx_stream.mlxlm import byte_decoder

        detokenizer = self.tokenizer.detokenizer
        if isinstance(detokenizer, SPMStreamingDetokenizer):
            return [b.replace("\u2581".encode(), b" ") for b in detokenizer.tokenmap]
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            table = byte_decoder()
            out = []
            for piece in detokenizer.tokenmap:
                piece = piece or ""
                out.append(b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece))
            return out
        decode = self.tokenizer.decode
        return [decode([i]).encode("utf-8") for i in range(len(self.tokenizer.vocab))]

    def _named(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token)
        value = logprob if logprob > FLOOR else FLOOR
        return {"token": raw.decode("utf-8", "replace"), "logprob": value, "bytes": list(raw)}

    def entry(self, token: int, logprobs: Any, top: int) -> dict[str, Any]:
        """``{"token", "logprob", "bytes", "top_logprobs": [...]}`` for ``token`` drawn
        from ``logprobs`` (V,) with the ``top`` most likely tokens, most likely first."""
        import mlx.core as mx

        row = logprobs.reshape(-1).astype(mx.float32)
        entry = self._named(token, row[token].item())
        alternatives = []
        if top > 0:
            ids = mx.argpartition(-row, kth=top - 1)[:top]
            pairs = sorted(zip(row[ids].tolist(), ids.tolist()), key=lambda p: (-p[0], p[1]))
            alternatives = [self._named(i, v) for v, i in pairs]
        entry["top_logprobs"] = alternatives
        return entry
