#!/bin/bash
# Train on several nodes under SLURM: one torchrun per node, which starts that node's ranks.
#     sbatch train_slurm.sh config/train300M_fsdp.yaml --resume_from=latest [--key=value ...]
# With --resume_from=latest the same command starts the run and continues it after a requeue.
# Edit the #SBATCH lines for your cluster; NPROC_PER_NODE (default: the GPUs SLURM gives each
# node) and MASTER_PORT may be set in the environment.
#SBATCH --job-name=gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1            # one task per node: its torchrun starts the ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=TERM@120              # SIGTERM 2 minutes before the time limit: save and exit
#SBATCH --output=slurm-%j.out
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: sbatch train_slurm.sh CONFIG [--key=value ...]" >&2; exit 2; }

# the first node of the allocation hosts the rendezvous (read whole: `| head -n 1` would end
# scontrol early with SIGPIPE, which pipefail turns into a failed job on large allocations)
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${hosts[0]} MASTER_PORT=${MASTER_PORT:-29500}
export NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}

# Single quotes: each node's task expands $SLURM_NODEID itself (0, 1, ...). Expanded here, in the
# batch shell, every node would get the head node's 0 and the rendezvous would never form.
srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" \
    --nproc_per_node="$NPROC_PER_NODE" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    train_fsdp.py "$@"' train_slurm "$@"
