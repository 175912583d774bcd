#!/usr/bin/env bash
#SBATCH --job-name=llama3_405b
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=USR1@120
#SBATCH --requeue
#
# Llama 3.1 405B on 64 nodes x 8 H100 = 512 ranks: tensor parallel 8 with sequence parallelism
# inside each node x pipeline parallel 8 (Interleaved1F1B, 2 stages per rank: 126 layers on 16
# stages) x FSDP 8, the planner's best layout for this job and torchtitan's 405B shape:
#
#   hybridpar plan --model llama3.1_405b --gpus 512 --gpu h100 --seq-len 8192 --global-batch 16Mtok --pp 8
#
# (58.3 GiB per GPU of 76 usable, 256 micro-batches of one sequence per step, a 1.3% bubble, about
# 151 tokens/s per GPU, MFU ~40% by its estimate). pp is the outermost dimension: stage s runs on
# nodes 8s .. 8s+7, and only its activations cross to the next stage's nodes. A preset of
# launch/slurm.sh, which does the work and documents every setting. Submit from the repository
# root; add your cluster's --partition/--account/--time to sbatch:
#
#   sbatch launch/llama3_405b.sh [-- --data.source ... --train.steps 1000]
#   bash launch/llama3_405b.sh --dry-run      # the srun/torchrun commands and the 512-rank mesh
set -euo pipefail

export MP=${MP:-8}
export PP=${PP:-8}
export NODES=${NODES:-64}
export PROCS_PER_NODE=${PROCS_PER_NODE:-8}
export DP_SHARD=${DP_SHARD:--1}  # the rest: 512 / (MP x PP)
export DP_REPLICATE=${DP_REPLICATE:-1}
export RUN_DIR=${RUN_DIR:-runs/llama3_405b}
# The planner's settings for this layout (its "config:" line, less the sizes above); yours come after and win.
plan=(--model.preset llama3.1_405b --data.seq_len 8192 --data.micro_batch_size 256 --train.grad_accum 1
  --parallel.pp_schedule Interleaved1F1B --parallel.pp_microbatches 256 --parallel.sequence_parallel true
  --fsdp.sharding_strategy full_shard --fsdp.activation_checkpointing full --fsdp.param_dtype bfloat16
  --fsdp.reduce_dtype float32)

# sbatch runs a copy of this file from its spool folder: find slurm.sh beside the original.
here=$(dirname -- "${BASH_SOURCE[0]}")
for script in "$here/slurm.sh" "${HYBRIDPAR_HOME:-${SLURM_SUBMIT_DIR:-.}}/launch/slurm.sh"; do
  [[ -f $script ]] && exec bash "$script" "${plan[@]}" "$@"
done
echo "llama3_405b.sh: error: launch/slurm.sh not found: submit from the repository root or set HYBRIDPAR_HOME" >&2
exit 2
