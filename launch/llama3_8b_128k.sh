#!/usr/bin/env bash
#SBATCH --job-name=llama3_8b_128k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=USR1@120
#SBATCH --requeue
#
# Llama 3.1 8B at 131,072 tokens per sequence on 2 nodes x 8 H100 = 16 ranks: tensor parallel 4 with
# sequence parallelism x context parallel 4, the planner's best layout for this job:
#
#   hybridpar plan --model llama3.1_8b --gpus 16 --gpu h100 --seq-len 131072 --global-batch 2Mtok
#
# (63.6 GiB per GPU of 76 usable, about 71 s per 2M-token step, MFU ~47% by its estimate). Each
# sequence is cut into 8 chunks; a cp rank holds 2 of them (32,768 tokens), an mp rank a quarter of
# those. A preset of launch/slurm.sh, which does the work and documents every setting. Submit from
# the repository root; add your cluster's --partition/--account/--time to sbatch:
#
#   sbatch launch/llama3_8b_128k.sh [-- --data.source ... --train.steps 1000]
#   bash launch/llama3_8b_128k.sh --dry-run      # the srun/torchrun commands and the 16-rank mesh
set -euo pipefail

export MP=${MP:-4}
export CP=${CP:-4}
export NODES=${NODES:-2}
export PROCS_PER_NODE=${PROCS_PER_NODE:-8}
export DP_SHARD=${DP_SHARD:--1}  # the rest: 16 / (MP x CP)
export DP_REPLICATE=${DP_REPLICATE:-1}
export RUN_DIR=${RUN_DIR:-runs/llama3_8b_128k}
# The planner's settings for this layout (its "config:" line, less the sizes above); yours come after and win.
plan=(--model.preset llama3.1_8b --data.seq_len 131072 --data.micro_batch_size 1 --train.grad_accum 16
  --parallel.sequence_parallel true --fsdp.sharding_strategy full_shard --fsdp.activation_checkpointing selective
  --fsdp.ac_every 2 --fsdp.param_dtype bfloat16 --fsdp.reduce_dtype float32)

# sbatch runs a copy of this file from its spool folder: find slurm.sh beside the original.
here=$(dirname -- "${BASH_SOURCE[0]}")
for script in "$here/slurm.sh" "${HYBRIDPAR_HOME:-${SLURM_SUBMIT_DIR:-.}}/launch/slurm.sh"; do
  [[ -f $script ]] && exec bash "$script" "${plan[@]}" "$@"
done
echo "llama3_8b_128k.sh: error: launch/slurm.sh not found: submit from the repository root or set HYBRIDPAR_HOME" >&2
exit 2
