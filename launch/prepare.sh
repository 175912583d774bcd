#!/usr/bin/env bash
#SBATCH --job-name=hybridpar-prepare
#SBATCH --array=0-3
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%A_%a.out
#
# Tokenise a corpus into a token store before training, one share per task of a Slurm job array,
# each on every core of its node. The last task to finish writes the store's manifest; a task that
# is killed or preempted is simply run again (it goes on where it stopped).
#
#   SOURCES="/data/fineweb-edu /data/stack.jsonl.zst" TOKENIZER=/models/llama3/tokenizer.model \
#       OUT=/data/store sbatch --array=0-7 launch/prepare.sh
#   SOURCES=... TOKENIZER=... OUT=... bash launch/prepare.sh        # one machine, every core
#
# Settings (environment):
#   SOURCES     the corpus files or folders, space-separated, in the order the store reads them
#   TOKENIZER   the tokenizer the model trains with (tokenizer.model, tokenizer.json or their folder)
#   OUT         the store folder, on a file system every task sees
#   PART/PARTS  the share (default: the array task's index and the array's size; 0/1 outside one)
#   WORKERS     processes per task (default: every core the task may use)
#   PREPARE_ARGS  more options for hybridpar prepare, e.g. "--text-field content --on-bad-record skip"
# Then: hybridpar verify "$OUT", and train with --data.source "$OUT".
set -euo pipefail

: "${SOURCES:?set SOURCES to the corpus files or folders}"
: "${TOKENIZER:?set TOKENIZER to the tokenizer the model trains with}"
: "${OUT:?set OUT to the store folder}"
PYTHON=${PYTHON:-python3}
PARTS=${PARTS:-${SLURM_ARRAY_TASK_COUNT:-1}}
PART=${PART:-$(( ${SLURM_ARRAY_TASK_ID:-0} - ${SLURM_ARRAY_TASK_MIN:-0} ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# shellcheck disable=SC2086  # SOURCES and PREPARE_ARGS are lists
exec "$PYTHON" -m hybridpar prepare $SOURCES --tokenizer "$TOKENIZER" --out "$OUT" --part "$PART/$PARTS" \
    --workers "${WORKERS:-0}" ${PREPARE_ARGS:-}
