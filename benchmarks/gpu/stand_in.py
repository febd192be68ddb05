"""Random weights for a model folder that holds only its config and tokenizer.

The default model's converted weights (98 MB) do not fit the two device calls beside
MLX's CUDA wheel, so by default only its config.json and tokenizer travel and this
writes ``model.safetensors`` of the same shapes and quantization (4-bit matrices,
8-bit embedding, groups of 32): the same work per token for the speed figures and the
same shapes for the exactness checks, not its perplexity or its drafts' acceptance.

    python benchmarks/gpu/stand_in.py FOLDER
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def write_weights(folder: Path, seed: int = 0) -> Path:
    """``folder/model.safetensors``: random weights quantized as ``config.json`` says."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map_with_path

    config = json.loads((folder / "config.json").read_text())
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    quant = config.get("quantization")
    if quant:

        def per_layer(path: str, layer) -> bool | dict:
            if not hasattr(layer, "to_quantized"):
                return False
            own = quant.get(path)
            return own if isinstance(own, dict) else True

        model.set_dtype(mx.float16)  # scales and biases in float16, as GGUF's are
        nn.quantize(model, quant["group_size"], quant["bits"], class_predicate=per_layer)
        # the norms stay float32, as the converted GGUF's do
        model.update(tree_map_with_path(
            lambda p, v: v.astype(mx.float32) if p.endswith("norm.weight") else v,
            model.parameters(),
        ))  # fmt: skip
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    path = folder / "model.safetensors"
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return path


if __name__ == "__main__":
    print(write_weights(Path(sys.argv[1])))
