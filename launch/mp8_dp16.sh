#!/usr/bin/env bash
#SBATCH --job-name=mp8_dp16
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=USR1@120
#SBATCH --requeue
#
# Llama 2 70B (hybridpar/configs/llama2_70b.toml) on 16 nodes x 8 GPUs = 128 ranks: model parallel 8
# inside each node, 16-way data parallel across nodes with hybrid sharding. A preset of
# launch/slurm.sh, which does the work and documents every setting (options and environment).
# Submit from the repository root; add your cluster's --partition/--account/--time to sbatch
# (or set SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT):
#
#   sbatch launch/mp8_dp16.sh [-- --train.steps 2000]
#   DP_SHARD=16 sbatch launch/mp8_dp16.sh          # full sharding over all 16 nodes
#   bash launch/mp8_dp16.sh --dry-run              # the srun/torchrun commands, the 128-rank mesh, and a
#                                                  # rehearsal of rank 0 on a fake process group (about a minute)
set -euo pipefail

export MP=${MP:-8}
export NODES=${NODES:-16}
export PROCS_PER_NODE=${PROCS_PER_NODE:-8}
# Shard group size. With mp 8 filling a node, each node is one data-parallel rank, so DP_SHARD is
# the number of nodes one FSDP shard group spans. Every layer's parameter all-gather and gradient
# reduce-scatter run inside that group (forward and backward); the replicas (DP_REPLICATE = 16 /
# DP_SHARD) meet once per step in one gradient all-reduce. The sharded training state is 16 bytes
# per parameter (fp32 weights, gradients, two Adam moments) over 8 x DP_SHARD GPUs: for 70B,
# 138 GB / DP_SHARD per GPU. 8 gives ~17 GB: room on an 80 GB GPU for this config's activations
# and, with train.grad_accum > 1, for the ~35 GB of unsharded gradients FSDP keeps between
# micro-batches, while the per-layer collectives stay on 8 nodes instead of all 16. 16 needs the
# least memory (~9 GB); 4 (~35 GB) leaves only a few GB spare once gradients accumulate.
# `hybridpar plan --model llama2_70b --gpus 128 --gpu-mem-gb 80 --seq-len 4096` prices each choice.
export DP_SHARD=${DP_SHARD:-8}
export DP_REPLICATE=${DP_REPLICATE:--1}  # the rest: 16 / DP_SHARD
export CONFIG=${CONFIG:-llama2_70b}
export RUN_DIR=${RUN_DIR:-runs/mp8_dp16}

# sbatch runs a copy of this file from its spool folder: find slurm.sh beside the original.
here=$(dirname -- "${BASH_SOURCE[0]}")
for script in "$here/slurm.sh" "${HYBRIDPAR_HOME:-${SLURM_SUBMIT_DIR:-.}}/launch/slurm.sh"; do
  [[ -f $script ]] && exec bash "$script" "$@"
done
echo "mp8_dp16.sh: error: launch/slurm.sh not found: submit from the repository root or set HYBRIDPAR_HOME" >&2
exit 2
