#!/usr/bin/env bash
# The first run on a GPU machine, in one command:  bash bench/gpu_check.sh
#   1 GPU:  the demo config; the 90M config in bf16, with and without compile, 50 steps each:
#           tokens/s, MFU, peak memory and loss from the trainer's own log lines
#   2+ GPUs: also the 2-rank parity test (NCCL) against one process
# Offline: the 90M model trains on the demo's byte corpus (the Python standard library), its
# vocabulary kept at 50304 so the shapes, FLOPs and memory are the 90M config's.
# Logs and checkpoints go to $OUT (default bench/runs/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/runs/gpu_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'bf16', torch.cuda.is_bf16_supported())"

run() {  # name, then trainer arguments
    local name=$1; shift
    echo "== $name"
    python train_fsdp.py "$@" --checkpoint_dir="$OUT/$name/ckpt" --tensorboard_dir="$OUT/$name/tb" \
        >"$OUT/$name.log" 2>&1 || { tail -30 "$OUT/$name.log"; return 1; }
    grep -E "^(parameters|step .*(tok/s|val loss)|memory per rank)" "$OUT/$name.log" | tail -6
}

run demo config/demo_cpu.yaml
BYTES_90M=(config/train90M_fsdp.yaml --data_path=data/stdlib_bytes --data_source=stdlib --tokenizer=bytes
           --dtype=bf16 --train_batch=64 --micro_batch=16 --max_iters=50 --warmup_iters=10 --log_interval=10
           --eval_interval=50 --eval_iters=2 --save_interval=50 --sample_tokens=0)
run 90M_bf16 "${BYTES_90M[@]}" --compile=false
run 90M_bf16_compile "${BYTES_90M[@]}" --compile=true

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    echo "== 2-rank parity on NCCL"
    CUDA_VISIBLE_DEVICES=0,1 python -m pytest -q tests/test_parity.py -k two_ranks_match_one_process
fi
