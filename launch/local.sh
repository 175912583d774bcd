#!/usr/bin/env bash
# The CPU quickstart: train the tiny Llama on 4 local processes (mp 2 x dp 2) on the embedded
# corpus. Installs hybridpar first if needed. Extra arguments override the config, e.g.
#   bash launch/local.sh --train.steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
# The processes say nothing until each has imported torch: seconds, more on a busy machine.
echo "launch/local.sh: starting 4 training processes (hybridpar/configs/local.toml); they load torch first" >&2
# Whether they are installed, not imported: importing them all takes seconds (tens on a busy machine).
if ! python3 -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('hybridpar', 'torch', 'sentencepiece', 'matplotlib', 'tensorboard')))"; then
    echo "launch/local.sh: installing hybridpar (torch 2.13.0 first, so no CUDA build is pulled in)"
    python3 -m pip install -q torch==2.13.0
    python3 -m pip install -q -e .
fi
# 4 processes share this machine's cores: one thread each avoids oversubscription.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m torch.distributed.run --standalone --nproc_per_node 4 \
    -m hybridpar train --config local "$@"
