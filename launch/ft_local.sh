#!/usr/bin/env bash
# Fault-tolerant replica groups on one machine (CPU, gloo): a torchft lighthouse and GROUPS groups of
# PROCS processes each (FT_GROUPS, PROCS below), every group its own torchrun that restarts it when one of its processes dies
# while the other groups train on. Extra arguments override the config, e.g.
#   FT_GROUPS=2 PROCS=2 bash launch/ft_local.sh --train.steps 40
# Each group logs to <output.run_dir>/group-<g>/ (and <run_dir>/group-<g>.log here); the checkpoints
# are shared, written by the first group of each step's quorum.
set -euo pipefail
cd "$(dirname "$0")/.."
FT_GROUPS=${FT_GROUPS:-2} PROCS=${PROCS:-2} RESTARTS=${RESTARTS:-3}
PORT=${LIGHTHOUSE_PORT:-29510} CONFIG=${CONFIG:-local} RUN_DIR=${RUN_DIR:-runs/ft_local}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$RUN_DIR"
echo "launch/ft_local.sh: a lighthouse on port $PORT and $FT_GROUPS replica group(s) of $PROCS process(es); logs in $RUN_DIR" >&2
python3 -m hybridpar lighthouse --port "$PORT" --min-groups 1 > "$RUN_DIR/lighthouse.log" 2>&1 &
lighthouse=$!
# (|| true: a lighthouse that died, or was replaced at its address, must not turn the groups' exit status into 1)
trap 'kill -KILL $lighthouse 2>/dev/null || true; kill $(jobs -p) 2>/dev/null || true' EXIT
export TORCHFT_LIGHTHOUSE=http://localhost:$PORT
pids=()
for ((g = 0; g < FT_GROUPS; g++)); do
    # --standalone: each group its own rendezvous, on a free port of its own
    python3 -m torch.distributed.run --standalone --nproc_per_node "$PROCS" --max-restarts "$RESTARTS" \
        -m hybridpar train --config "$CONFIG" --output.run_dir "$RUN_DIR" --fault_tolerance.enabled true \
        --fault_tolerance.groups "$FT_GROUPS" --fault_tolerance.group "$g" "$@" > "$RUN_DIR/group-$g.log" 2>&1 &
    pids+=($!)
    echo "launch/ft_local.sh: group $g is process $! (its log: $RUN_DIR/group-$g.log)" >&2
done
# A stop signal to the script's process group (Ctrl-C, kill -TERM -PGID, as scancel signals a job) reaches
# every torchrun, which passes it on once (a second signal would cut its wait for the ranks short): the
# groups save after the same step while the lighthouse serves on, and the script waits for them.
stop() { wait "${pids[@]}" || true; exit $((128 + $1)); }
trap 'stop 15' TERM
trap 'stop 2' INT
status=0
for g in "${!pids[@]}"; do
    wait "${pids[$g]}" || { echo "launch/ft_local.sh: group $g failed (exit $?): see $RUN_DIR/group-$g.log" >&2; status=1; }
done
exit $status
