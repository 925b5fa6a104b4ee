#!/usr/bin/env bash
# The first run on a GPU machine, offline, with the torch it has (2.6 or newer, no pip):
#     bash bench/gpu_check.sh [--key=value ...]
# 1. the demo config as it is;
# 2. the 90M GPT-2 config (AdamW) and the Llama 124M config with Muon, in bf16, eager and compiled,
#    50 steps each on the demo's byte corpus with the vocabulary kept at 50,304: the configs'
#    shapes, FLOPs and memory, no tokenizer download;
# 3. the GPU tests (python -m pytest -m gpu), where pytest is installed.
# Then one markdown table (tok/s, MFU, peak memory, last loss per run) for the README, printed and
# written to $GPU_CHECK_DIR/table.md. Extra --key=value arguments go to every run, last (the test
# suite runs the script at tiny size on CPU that way). Logs and checkpoints: $GPU_CHECK_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
DIR=${GPU_CHECK_DIR:-bench/runs/gpu_check}
mkdir -p "$DIR"
"$PYTHON" -c "import torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'
print(f'{gpu}, {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, CUDA {torch.version.cuda}')" \
    | tee "$DIR/machine.txt"

LOGS=()
FAILED=0
run() {  # name, then trainer arguments; a failed run is shown, and the others still run
    local name=$1; shift
    echo "== $name"
    LOGS+=("$DIR/$name.log")
    if "$PYTHON" train_fsdp.py "$@" --checkpoint_dir="$DIR/$name/ckpt" --tensorboard_dir="$DIR/$name/tb" \
        "${EXTRA[@]}" >"$DIR/$name.log" 2>&1; then
        grep -E "^(parameters|step .*(tok/s|val loss)|memory per rank)" "$DIR/$name.log" | tail -4
    else
        tail -30 "$DIR/$name.log"
        FAILED=1
    fi
}

EXTRA=("$@")
run demo config/demo_cpu.yaml
BYTES=(--data_path=data/stdlib_bytes --data_source=stdlib --tokenizer=bytes --vocab_size=50304 --dtype=bf16
       --train_batch=64 --micro_batch=16 --max_iters=50 --warmup_iters=10 --lr_decay_iters=50 --log_interval=10
       --eval_interval=50 --eval_iters=2 --save_interval=50 --sample_tokens=0 --world_size=null)
run gpt2_90M config/train90M_fsdp.yaml "${BYTES[@]}" --compile=false
run gpt2_90M_compile config/train90M_fsdp.yaml "${BYTES[@]}" --compile=true
run llama_124M_muon config/llama_124M.yaml "${BYTES[@]}" --optimizer=muon --compile=false
run llama_124M_muon_compile config/llama_124M.yaml "${BYTES[@]}" --optimizer=muon --compile=true

TESTS="not run: torch sees no GPU"
if "$PYTHON" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    if "$PYTHON" -c "import pytest" 2>/dev/null; then
        echo "== GPU tests"
        # one process, no pytest-xdist: the GPU tests share one device
        "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/ >"$DIR/gpu_tests.log" 2>&1 || FAILED=1
        TESTS=$(tail -1 "$DIR/gpu_tests.log")
    else
        TESTS="not run: pytest is not installed (pip install -r requirements-dev.txt)"
    fi
fi
{
    "$PYTHON" bench/gpu_table.py "${LOGS[@]}"
    echo
    echo "$(date +%F), $(cat "$DIR/machine.txt"). GPU tests: $TESTS"
} | tee "$DIR/table.md"
exit $FAILED
