#!/usr/bin/env bash
# The GPU run: the one prepared device command, in two phases (benchmarks/gpu/README.md).
#
#   bash benchmarks/gpu/run.sh part1              # every call but the last: stash its folder
#   bash benchmarks/gpu/run.sh part2              # the last call: stash, join, check, install,
#                                                 #   then the suite, each part under `timeout`
#   bash benchmarks/gpu/run.sh part2 --dry-run    # here: the same pipeline on MLX's CPU
#                                                 #   backend, tiny sizes (under 3 minutes)
#   bash benchmarks/gpu/run.sh part2 --dry-run --tiny   # the tiny model everywhere (tests)
#
# Results go to $OUT (the device tool brings back what is written there; here
# benchmarks/gpu/out): run.log, phases.jsonl (each part's exit status and seconds) and one
# JSON-lines file per part, appended as it runs, so a part cut short keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
GPU=benchmarks/gpu
STEP=${1:-}
shift || true
DRY=0
TINY=0
for arg in "$@"; do
    case $arg in
        --dry-run | --cpu) DRY=1 ;;
        --tiny) TINY=1 ;;
        *) echo "run.sh: unknown option $arg" >&2; exit 2 ;;
    esac
done
case $STEP in part1 | part2) ;; *) echo "usage: run.sh part1|part2 [--dry-run] [--tiny]" >&2; exit 2 ;; esac
START=$SECONDS
if [ $DRY = 1 ]; then
    STASH=${MLX_STREAM_GPU_STASH:-$(mktemp -d)}
    OUT=${OUT:-$GPU/out}
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    DEADLINE=170
else
    STASH=/tmp/mlx-stream-gpu  # kept between the calls while the machine stays warm (30 s)
    OUT=${OUT:-$GPU/out}
    PY=python3  # the image's (Python 3.12, with PyTorch and the NVIDIA libraries)
    DEADLINE=560  # under the device's 10 minutes a command, install included
fi
mkdir -p "$STASH/parts" "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/run.log

say() { echo "run.sh: $*" | tee -a "$LOG"; }

stash() {
    local n=0
    for folder in "$GPU"/carry/call*/; do
        [ -d "$folder" ] || continue
        cp "$folder"* "$STASH/parts/" && n=$((n + 1))
    done
    say "stashed $n carried folder(s) in $STASH/parts ($(du -sm "$STASH/parts" | cut -f1) MiB there)"
}

if [ "$STEP" = part1 ]; then
    stash
    exit 0
fi

# ---- part2: join, check, install ------------------------------------------------------
stash
SITE=$STASH/site
MODEL_DIR=$STASH/model
if [ -f "$STASH/parts/manifest.json" ]; then
    "$PY" "$GPU/pack.py" join "$STASH/parts" "$STASH/files" 2>&1 | tee -a "$LOG"
    if [ "${PIPESTATUS[0]}" != 0 ]; then
        say "the parts are incomplete: the machine went cold between the calls (or a call" \
            "carried the wrong folder); run part1 and part2 again, back to back"
        exit 1
    fi
    rm -rf "$SITE" "$MODEL_DIR" && mkdir -p "$SITE" "$MODEL_DIR"
    target=()
    if [ $DRY = 1 ]; then  # the device's interpreter, not this one: unpacked, not imported
        target=(--python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64)
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        "${target[@]}" --target "$SITE" "$STASH"/files/*.whl >>"$LOG" 2>&1 \
        || { say "pip install failed (see run.log)"; exit 1; }
    tar -xJf "$STASH"/files/mlx_cuda_13-*.tar.xz -C "$SITE" || { say "CUDA files failed"; exit 1; }
    say "installed $(ls "$STASH"/files/*.whl | wc -l) wheels and mlx-cuda-13 into $SITE" \
        "($(du -sm "$SITE" | cut -f1) MiB)"
    name=smollm2-135m-random
    [ -f "$STASH/files/model.safetensors" ] && name=smollm2-135m-instruct
    mkdir -p "$MODEL_DIR/$name"
    tar -xJf "$STASH/files/model-shape.tar.xz" -C "$MODEL_DIR/$name"
    [ -f "$STASH/files/model.safetensors" ] && mv "$STASH/files/model.safetensors" "$MODEL_DIR/$name/"
    MODEL=$MODEL_DIR/$name
elif [ $DRY = 1 ]; then
    say "no benchmarks/gpu/carry here (prepare.sh not run): join and install skipped"
    MODEL=
else
    say "nothing carried: give this call benchmarks/gpu/carry/call2 (README.md)"
    exit 1
fi

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MLX_STREAM_HOME=$STASH/home
if [ $DRY = 1 ]; then
    export PYTHONPATH=$REPO
else
    # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia/*: the image's own.
    nvidia=$("$PY" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>>"$LOG")
    [ -n "$nvidia" ] && ln -sfn "$nvidia" "$SITE/nvidia"
    LD_LIBRARY_PATH=$(ls -d "$nvidia"/*/lib 2>/dev/null | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
    # NVRTC (MLX's fused kernels) reads CUDA's headers: the toolkit's, else the wheels'.
    [ -n "${CUDA_HOME:-}" ] || [ -d /usr/local/cuda ] || export CUDA_HOME=$nvidia/cu13
    export PYTHONPATH=$REPO:$SITE  # the tree's code first: a fix needs no new wheel
    export MLX_STREAM_BLAS=off     # no OpenBLAS preload beside the CUDA backend
fi
tiny_folder() {  # a tiny llama folder for the benchmarks; head_dim 64, which 64-wide
    MODEL=$MODEL_DIR/tiny-llama  # groups of the quantized caches divide
    "$PY" -c "import sys; from tests import tiny; tiny.save_model_folder(sys.argv[1], \
hidden_size=128, num_attention_heads=2, num_key_value_heads=1)" "$MODEL"
}
if [ $TINY = 1 ] || [ -z "$MODEL" ]; then  # the exactness script builds its own tiny ones
    tiny_folder
elif [ ! -f "$MODEL/model.safetensors" ]; then
    "$PY" "$GPU/stand_in.py" "$MODEL" >>"$LOG" 2>&1 || { say "stand_in.py failed"; exit 1; }
fi

# ---- the device, then the suite -------------------------------------------------------
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1
"$PY" - >>"$LOG" 2>&1 <<'EOF'
import json, platform
import mlx.core as mx
a = mx.random.normal((1024, 1024))
mx.eval(a @ a)
info = getattr(mx, "device_info", lambda: {})()
print(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                  "python": platform.python_version(), "device_info": info}, default=str))
EOF
device=$("$PY" -c "import mlx.core as mx; print(mx.default_device().type.name)" 2>>"$LOG")
say "MLX computes on: ${device:-nothing (see run.log)}; model: $MODEL"
if [ $DRY = 0 ] && [ "$device" != gpu ]; then
    say "MLX sees no GPU: stopping before the suite (run.log has the probe's output)"
    exit 1
fi

phase() {  # phase NAME CAP COMMAND...: one part under `timeout`, its status in phases.jsonl
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - (SECONDS - START)))
    if [ -n "${MLX_STREAM_GPU_PHASES:-}" ] && [[ ",$MLX_STREAM_GPU_PHASES," != *",$name,"* ]]; then
        return  # not among the parts asked for (the smoke test runs a few)
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    if [ "$cap" -lt 10 ]; then
        say "$name: skipped, ${left}s left"
        echo "{\"phase\": \"$name\", \"rc\": null, \"skipped\": true}" >>"$OUT/phases.jsonl"
        return
    fi
    say "$name: up to ${cap}s"
    local tic=$SECONDS
    timeout -k 10 "$cap" "$@" >>"$LOG" 2>&1
    local rc=$?
    say "$name: exit $rc after $((SECONDS - tic))s$([ $rc = 124 ] && echo ' (cut at its cap)')"
    echo "{\"phase\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - tic)), \"cap\": $cap}" \
        >>"$OUT/phases.jsonl"
}

B=benchmarks
if [ $DRY = 0 ]; then
    phase exactness 110 "$PY" $GPU/exactness.py --model "$MODEL" --out "$OUT/exactness.jsonl"
    phase pytest 110 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -ra \
        -m "not slow and not real_model and not agents" tests/test_cache.py tests/test_decode.py \
        tests/test_kvquant.py tests/test_cache_quantized.py tests/test_batch.py \
        tests/test_recall_persist.py --junitxml="$OUT/pytest.xml"
    phase decode-windows 70 "$PY" $B/decode.py --model "$MODEL" --tokens 64 --repeats 3 \
        --windows 256,512,1024,2048,4096,8192 --out "$OUT/decode_windows.jsonl"
    phase decode-contexts 100 "$PY" $B/decode.py --model "$MODEL" --window 1024 --tokens 64 \
        --repeats 2 --contexts 1024,4096,16384,65536 --full-max 65536 \
        --out "$OUT/decode_contexts.jsonl"
    phase spec-memory 45 "$PY" $B/spec_memory.py --model "$MODEL" --tokens 2048 \
        --out "$OUT/spec_memory.jsonl"
    phase soak 60 "$PY" $B/soak.py --model "$MODEL" --tokens 1000000 --window 1024 \
        --out "$OUT/soak.jsonl"
else  # the tiny model for the benchmarks: the 135M one takes minutes on two CPU cores
    phase exactness 40 "$PY" $GPU/exactness.py --models tiny --dtypes float32 \
        --checks kvcache,speculative,recall --quick --out "$OUT/exactness.jsonl"
    if [ $TINY = 0 ]; then
        phase exactness-default 60 "$PY" $GPU/exactness.py --model "$MODEL" --models default \
            --dtypes float32 --checks kvcache --quick --out "$OUT/exactness.jsonl"
        tiny_folder
    fi
    phase pytest 40 "$PY" -m pytest -q -p no:cacheprovider -o addopts= \
        tests/test_cache.py -k before_first_eviction --junitxml="$OUT/pytest.xml"
    phase decode-windows 30 "$PY" $B/decode.py --model "$MODEL" --quick --windows 16,32 \
        --out "$OUT/decode_windows.jsonl"
    phase decode-contexts 30 "$PY" $B/decode.py --model "$MODEL" --quick \
        --out "$OUT/decode_contexts.jsonl"
    phase spec-memory 30 "$PY" $B/spec_memory.py --model "$MODEL" --quick \
        --out "$OUT/spec_memory.jsonl"
    phase soak 30 "$PY" $B/soak.py --model "$MODEL" --quick --tokens 1024 \
        --out "$OUT/soak.jsonl"
fi
for f in "$OUT"/*.jsonl; do say "$(basename "$f"): $(wc -l <"$f") lines"; done
grep -h '"summary": true' "$OUT/exactness.jsonl" 2>/dev/null | "$PY" -c \
    "import json, sys; [print('exactness:', r['passed'], 'of', r['checks'], 'passed; failed:', \
r['failed']) for r in map(json.loads, sys.stdin)]" | tee -a "$LOG"
say "done in $((SECONDS - START))s; results in $OUT"
