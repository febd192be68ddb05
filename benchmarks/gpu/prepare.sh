#!/usr/bin/env bash
# Here, where PyPI is reachable: fetch what the device lacks and pack it into the folders
# the device calls carry (benchmarks/gpu/carry/callN, git-ignored), each small enough that
# the working tree plus that folder stays under the 64 MiB one call takes.
#
#   bash benchmarks/gpu/prepare.sh             # two calls: the default model's shapes only
#   bash benchmarks/gpu/prepare.sh --weights   # three calls: its real weights too
#
# Carried (the device's python3 is 3.12 with numpy, transformers, tokenizers, jinja2,
# protobuf, pyyaml, typer, rich, pytest and the NVIDIA CUDA 13 libraries already; see
# /work/.library/device/KINDS.md): mlx and mlx-cuda-13 0.32.4, mlx-lm at this project's
# pin, platformdirs and ruamel.yaml, this project's wheel, and the default model's config
# and tokenizer. MLX's CUDA wheel (89.8 MB) travels as an xz tar of its files (75 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU=benchmarks/gpu
WHEELS=$GPU/wheels
CARRY=$GPU/carry
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((2 * 1024 * 1024))  # the tree may grow a little before the calls
MLX=0.32.4
MLX_LM=$(grep -oE 'mlx-lm>=[0-9.]+' pyproject.toml | cut -d= -f2)
WEIGHTS=0
[ "${1:-}" = --weights ] && WEIGHTS=1

mkdir -p "$WHEELS"
read -r PLATFORMDIRS RUAMEL < <("$PY" -c "from importlib.metadata import version as v; \
print(v('platformdirs'), v('ruamel.yaml'))")
echo "downloading wheels for the device's Python 3.12 (x86_64) into $WHEELS"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
    "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==$MLX_LM" "platformdirs==$PLATFORMDIRS" \
    "ruamel.yaml==$RUAMEL" 2>&1 | grep -v "^WARNING: Location" || true
rm -f "$WHEELS"/mlx_stream-*.whl
python3 -m pip wheel -q --no-deps -w "$WHEELS" . 2>&1 | grep -v "^WARNING: Location" || true

CUDA_WHEEL=$(ls "$WHEELS"/mlx_cuda_13-$MLX-*.whl)
CUDA_TAR=$WHEELS/mlx_cuda_13-$MLX.tar.xz
if [ ! -s "$CUDA_TAR" ] || [ "$CUDA_WHEEL" -nt "$CUDA_TAR" ]; then
    echo "repacking $(basename "$CUDA_WHEEL") as an xz tar (about 3 minutes)"
    scratch=$(mktemp -d)
    (cd "$scratch" && unzip -q "$OLDPWD/$CUDA_WHEEL")
    tar -C "$scratch" -cf - . | xz -9 > "$CUDA_TAR.tmp" && mv "$CUDA_TAR.tmp" "$CUDA_TAR"
    rm -rf "$scratch"
fi

MODEL=$("$PY" -c "from mlx_stream.models.loader import model_path; print(model_path())")
if [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" -c "from mlx_stream.models.loader import pull; pull()"
fi
# The model's folder without its weights (stand_in.py writes random ones of its shapes).
tar -C "$MODEL" -cJf "$WHEELS/model-shape.tar.xz" --exclude model.safetensors .
files=("$CUDA_TAR" "$WHEELS"/mlx-$MLX-*.whl "$WHEELS"/mlx_lm-$MLX_LM-*.whl \
       "$WHEELS"/platformdirs-*.whl "$WHEELS"/ruamel_yaml-*.whl "$WHEELS"/mlx_stream-*.whl \
       "$WHEELS/model-shape.tar.xz")
[ $WEIGHTS = 1 ] && files+=("$MODEL/model.safetensors")

# What else travels with each call: tracked and untracked-not-ignored files.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
       | awk '{s += $1} END {print s}')
budget=$((LIMIT - tree - MARGIN))
echo "working tree $((tree / 1024)) KiB; each call's folder at most $((budget / 1024)) KiB"
"$PY" "$GPU/pack.py" pack --budget "$budget" --out "$CARRY" "${files[@]}"
calls=$(ls -d "$CARRY"/call* | wc -l)
for i in $(seq 1 "$calls"); do
    size=$(du -sb "$CARRY/call$i" | cut -f1)
    total=$((tree + size))
    [ $total -le $LIMIT ] || { echo "call$i: $total bytes with the tree, over $LIMIT" >&2; exit 1; }
    echo "call$i carries $CARRY/call$i: $((total / 1024)) KiB with the tree (limit $((LIMIT / 1024)))"
done
echo "device calls: $calls (see benchmarks/gpu/README.md)"
