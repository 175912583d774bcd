#!/usr/bin/env bash
#SBATCH --job-name=hybridpar
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%x-%j.out
#SBATCH --signal=USR1@120
#SBATCH --requeue
#
# Train on a Slurm allocation: srun starts one torchrun agent per node, each agent starts
# PROCS_PER_NODE ranks, and the agents meet (c10d rendezvous) on the first host of the job.
# Options given to sbatch override the #SBATCH lines above (sbatch reads them only above the first
# command). GPU nodes train with nccl, CPU nodes with gloo.
#
#   sbatch --nodes 2 --gpus-per-node 8 launch/slurm.sh --procs-per-node 8 --mp 8
#   MP=2 PROCS_PER_NODE=2 sbatch --nodes 2 launch/slurm.sh -- --train.steps 50       # CPU nodes
#   NODES=16 PROCS_PER_NODE=8 MP=8 bash launch/slurm.sh --dry-run   # print the commands and the mesh
#
# Settings: the option, else the environment variable, else the default.
#   --mp / MP                          model-parallel (tensor-parallel) size; contiguous ranks, so a
#                                      group stays inside a node when MP divides PROCS_PER_NODE (1)
#   --cp / CP                          context-parallel ranks per sequence (1); next to mp, and FSDP
#                                      shards over dp_shard x cp
#   --pp / PP                          pipeline stages' ranks (1); the outermost dimension, so a stage's
#                                      ranks are contiguous and its neighbours one mp x cp x dp block away
#   --dp-shard / DP_SHARD              ranks an FSDP shard group spans (-1: what the others leave)
#   --dp-replicate / DP_REPLICATE      replicas of each shard group (1; -1: what the others leave)
#   --nodes / NODES                    the allocation's node count (needed only for --dry-run outside one)
#   --procs-per-node / PROCS_PER_NODE  ranks per node (default: the GPUs the job has on the node, so
#                                      request them with --gpus-per-node; set it on CPU nodes)
#   --config / CONFIG                  a TOML file or a named config of hybridpar/configs (local)
#   --ft / FT=1                        replica groups that fail alone (torchft; the sizes are a group's):
#                                      launch/slurm_ft.sh (GROUP_NODES, MIN_GROUPS, LIGHTHOUSE_PORT)
#   --dry-run / DRY_RUN=1              print the srun and torchrun commands and the mesh, then rehearse
#                                      the job in this one process (hybridpar train --dry-run: the real
#                                      model, sharding and one step as rank DRY_RUN_RANK of the world,
#                                      on a fake process group); start nothing
#   REHEARSE       0: --dry-run prints the commands and the mesh only (1)
#   DRY_RUN_RANK   the rank the rehearsal plays (0); DRY_RUN_JSON: also write its report there;
#                  DRY_RUN_GPU: the GPU of its step-time estimate (a100, h100, h100-500w; default a100)
#   RUN_DIR        the run folder (runs/<job name>): checkpoints/ shared by every job of the run,
#                  job-<id>/ for each job's logs, metrics, layout and flight-recorder traces
#   RDZV_HOST      rendezvous host (the first host of SLURM_JOB_NODELIST)
#   RDZV_PORT      rendezvous port (15000 + job id % 20000, so jobs sharing a first host differ)
#   MAX_RESTARTS   how often torchrun restarts every rank after a failure; each restart resumes
#                  from the newest complete checkpoint (3)
#   PREFLIGHT      1: before training, every rank joins the mesh and reports its place (1)
#   PYTHON         the interpreter with hybridpar installed (python3)
#   REQUEUE        1: a run stopped by a signal (the --signal=USR1@120 above, ahead of the time
#                  limit; a preemption; scancel --signal=USR1) saves its step, and this script then
#                  requeues the job, which resumes from that checkpoint; 0: it just ends (1)
#   EXCLUDE_ON_FAULT  1: when the watchdog's verdict blames a node (its ranks stalled, hung in a
#                  collective, died twice, or lag as stragglers), end the attempt, exclude that node
#                  and requeue the job, which resumes from the newest checkpoint on other nodes; a
#                  fault that is not a node's (bad config, NaN loss, full disk) is never requeued;
#                  every fault goes to RUN_DIR/incidents.jsonl (1)
#   MAX_REQUEUES   requeues after node faults before the job gives up (3); it also stops when the
#                  partition has no spare node left
#   REQUEUE_DELAY  seconds a job requeued after a node fault waits before it may start (10; Slurm's
#                  own hold, its credential lifetime, is 120 s)
# Any other argument (e.g. --train.steps 50), and everything after `--`, overrides the config.
set -euo pipefail

die() { echo "slurm.sh: error: $*" >&2; exit 2; }

MP=${MP:-1}
CP=${CP:-1}
PP=${PP:-1}
DP_SHARD=${DP_SHARD:--1}
DP_REPLICATE=${DP_REPLICATE:-1}
NODES=${NODES:-}
PROCS_PER_NODE=${PROCS_PER_NODE:-}
CONFIG=${CONFIG:-local}
DRY_RUN=${DRY_RUN:-0}
MAX_RESTARTS=${MAX_RESTARTS:-3}
PREFLIGHT=${PREFLIGHT:-1}
REHEARSE=${REHEARSE:-1}
DRY_RUN_RANK=${DRY_RUN_RANK:-0}
DRY_RUN_JSON=${DRY_RUN_JSON:-}
DRY_RUN_GPU=${DRY_RUN_GPU:-}
REQUEUE=${REQUEUE:-1}
EXCLUDE_ON_FAULT=${EXCLUDE_ON_FAULT:-1}
MAX_REQUEUES=${MAX_REQUEUES:-3}
REQUEUE_DELAY=${REQUEUE_DELAY:-10}
PYTHON=${PYTHON:-python3}
FT=${FT:-0} GROUP_NODES=${GROUP_NODES:-1} RDZV_GIVEN=${RDZV_HOST:-}  # (--ft: given, every group meets there)

set_option() {
  case $1 in
    --mp) MP=$2 ;;
    --cp) CP=$2 ;;
    --pp) PP=$2 ;;
    --dp-shard) DP_SHARD=$2 ;;
    --dp-replicate) DP_REPLICATE=$2 ;;
    --nodes) NODES=$2 ;;
    --procs-per-node) PROCS_PER_NODE=$2 ;;
    --config) CONFIG=$2 ;;
  esac
}
overrides=()
while (($#)); do
  case $1 in
    --mp | --cp | --pp | --dp-shard | --dp-replicate | --nodes | --procs-per-node | --config)
      (($# >= 2)) || die "$1 needs a value"
      set_option "$1" "$2"
      shift 2 ;;
    --mp=* | --cp=* | --pp=* | --dp-shard=* | --dp-replicate=* | --nodes=* | --procs-per-node=* | --config=*)
      set_option "${1%%=*}" "${1#*=}"
      shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --ft) FT=1; shift ;;
    --) shift; overrides+=("$@"); break ;;
    *) overrides+=("$1"); shift ;;
  esac
done

is_int() { [[ $1 =~ ^-?[0-9]+$ ]]; }
for name in MP CP PP DP_SHARD DP_REPLICATE MAX_RESTARTS MAX_REQUEUES REQUEUE_DELAY EXCLUDE_ON_FAULT FT; do
  is_int "${!name}" || die "$name must be an integer, got '${!name}'"
done

# --- the allocation -----------------------------------------------------------------------------
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  NODES=${NODES:-$SLURM_NNODES}
  [[ $NODES == "$SLURM_NNODES" ]] ||
    die "NODES=$NODES but the job has $SLURM_NNODES nodes: submit with sbatch --nodes $NODES (or unset NODES)"
elif [[ $DRY_RUN != 1 ]]; then
  die "not inside a Slurm job: submit it, e.g. 'sbatch --nodes 2 launch/slurm.sh --procs-per-node 8', or add --dry-run"
fi
NODES=${NODES:-1}
if [[ -z $PROCS_PER_NODE ]]; then
  if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    PROCS_PER_NODE=$SLURM_GPUS_ON_NODE
  elif command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && ((gpus > 0)); then
    PROCS_PER_NODE=$gpus
  else
    die "no GPUs found: set PROCS_PER_NODE (or --procs-per-node), the ranks to start on each node"
  fi
fi
for name in NODES PROCS_PER_NODE GROUP_NODES; do
  [[ ${!name} =~ ^[1-9][0-9]*$ ]] || die "$name must be a positive integer, got '${!name}'"
done
WORLD=$((FT ? GROUP_NODES * PROCS_PER_NODE : NODES * PROCS_PER_NODE))  # with --ft: a replica group's

# cp and pp appear in the commands, the sizes and the messages only when set: such jobs print as before.
CP_WORD=""; CP_ARGS=(); CP_MESH=""; PP_WORD=""; PP_ARGS=(); PP_MESH=""
if ((CP != 1)); then
  CP_WORD=" x CP"; CP_ARGS=(--parallel.cp "$CP"); CP_MESH=" --cp $CP"
fi
if ((PP != 1)); then
  PP_WORD=" x PP"; PP_ARGS=(--parallel.pp "$PP"); PP_MESH=" --pp $PP"
fi
# The sizes besides the data-parallel ones, as the messages name them.
FIXED=$((MP * CP * PP)); FIXED_WORDS="MP$CP_WORD$PP_WORD"; FIXED_SIZES="$MP x ${CP_WORD:+$CP x }${PP_WORD:+$PP x }"
# -1 takes what the other sizes leave (sizes that do not tile are left for hybridpar's error).
if ((DP_REPLICATE == -1)); then
  ((DP_SHARD > 0)) || die "DP_SHARD and DP_REPLICATE cannot both be -1: give one of them a size"
  ((MP > 0 && CP > 0 && PP > 0 && WORLD % (FIXED * DP_SHARD) == 0)) ||
    die "$WORLD ranks ($NODES nodes x $PROCS_PER_NODE) are not divisible by $FIXED_WORDS x DP_SHARD = $FIXED_SIZES$DP_SHARD"
  DP_REPLICATE=$((WORLD / (FIXED * DP_SHARD)))
elif ((DP_SHARD == -1 && MP > 0 && CP > 0 && PP > 0 && DP_REPLICATE > 0 && WORLD % (FIXED * DP_REPLICATE) == 0)); then
  DP_SHARD=$((WORLD / (FIXED * DP_REPLICATE)))  # resolved here so the logs show the real size
fi
if ((MP > 0 && PROCS_PER_NODE % MP != 0)); then
  echo "slurm.sh: warning: MP=$MP does not divide PROCS_PER_NODE=$PROCS_PER_NODE: some model-parallel" \
    "groups span two nodes, and their every-layer traffic leaves the node" >&2
fi

# --- where things go ----------------------------------------------------------------------------
JOB_ID=${SLURM_JOB_ID:-dryrun}
RUN_DIR=$(realpath -m -- "${RUN_DIR:-runs/${SLURM_JOB_NAME:-hybridpar}}")
JOB_DIR=$RUN_DIR/job-$JOB_ID
CKPT_DIR=$RUN_DIR/checkpoints
INCIDENTS=$RUN_DIR/incidents.jsonl

if [[ -z ${RDZV_HOST:-} ]]; then
  if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    if command -v scontrol >/dev/null; then
      mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    else
      mapfile -t hosts < <("$PYTHON" -c 'import sys; from hybridpar.mesh.layout import expand_nodelist
print("\n".join(expand_nodelist(sys.argv[1])))' "$SLURM_JOB_NODELIST")
    fi
    RDZV_HOST=${hosts[0]:?could not expand SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST}
  else
    RDZV_HOST=$(hostname)  # a dry run outside a job: this machine stands for the first node
  fi
fi
RDZV_PORT=${RDZV_PORT:-$((15000 + ${SLURM_JOB_ID:-0} % 20000))}

# --- environment of every rank --------------------------------------------------------------------
CPUS_PER_NODE=${SLURM_CPUS_ON_NODE:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((CPUS_PER_NODE / PROCS_PER_NODE > 0 ? CPUS_PER_NODE / PROCS_PER_NODE : 1))}
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A failed or timed-out NCCL collective tears the process down instead of hanging: torchrun then
# sees a dead rank and restarts (or srun ends the job).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
# The flight recorder keeps the last 2000 collectives of every group; when an NCCL collective times
# out each rank writes them to the job folder: which rank never joined, in which group.
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$JOB_DIR/flight_recorder/flight_recorder_rank_}
# The job's store in rank 0's process, made afresh for each attempt, rather than torchrun's agent's
# (kept across restarts; hybridpar copes with either: hybridpar/mesh/rendezvous.py): a node that
# stalls then takes the store with it, which the other nodes' ranks notice and name (test_heal).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# torchrun passes these on to every rank, which then finishes its step, saves and exits (SIGUSR1 is
# Slurm's warning ahead of the time limit; without it in the list torchrun would die of it). The
# variable is torchrun's --signals-to-handle (torch >= 2.9; older torchruns ignore it and handle
# SIGTERM only, which is what scancel and the time limit itself send).
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
# Cluster-specific network choices (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) are left to the environment.
export MP CP PP DP_SHARD DP_REPLICATE
export LAYOUT_FILE=$JOB_DIR/layout.txt
export HYBRIDPAR_INCIDENTS=$INCIDENTS  # the trainer notes there when it trains again after a fault

# --- the commands ---------------------------------------------------------------------------------
srun_cmd=(srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label)
# A step gets every GPU the job requested (request them: --gpus-per-node; with --exclusive alone it
# gets none), but since Slurm 22.05 not the job's CPUs per task: give the agent the whole node.
[[ -n ${SLURM_CPUS_ON_NODE:-} ]] && srun_cmd+=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
rdzv=(--nnodes="$NODES" --nproc-per-node="$PROCS_PER_NODE" --rdzv-backend=c10d
  --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT")
train_overrides=(--parallel.mp "$MP" "${CP_ARGS[@]}" "${PP_ARGS[@]}" --parallel.dp_shard "$DP_SHARD" --parallel.dp_replicate "$DP_REPLICATE"
  --output.run_dir "$JOB_DIR" --checkpoint.folder "$CKPT_DIR" --checkpoint.resume true "${overrides[@]}")
torchrun_cmd=("$PYTHON" -m torch.distributed.run "${rdzv[@]}" --rdzv-id="$JOB_ID"
  --max-restarts="$MAX_RESTARTS" --log-dir="$JOB_DIR/torchrun" --tee=3
  -m hybridpar train --config "$CONFIG" "${train_overrides[@]}")
export MESH_ARGS="mesh --world $WORLD --mp $MP$CP_MESH$PP_MESH --dp-shard $DP_SHARD --dp-replicate $DP_REPLICATE --procs-per-node $PROCS_PER_NODE"
mesh_cmd=("$PYTHON" -m hybridpar $MESH_ARGS)

# Each rank joins the real mesh once and reports where it landed; rank 0 writes layout.txt.
read -r -d '' PREFLIGHT_PY <<'PY' || true
import os, socket
import torch.distributed as dist
from hybridpar.files import write_text_atomic
from hybridpar.mesh.layout import group_ranks
from hybridpar.mesh.device import init_parallel
p = init_parallel(mp=int(os.environ["MP"]), dp_shard=int(os.environ["DP_SHARD"]),
                  dp_replicate=int(os.environ["DP_REPLICATE"]), cp=int(os.environ["CP"]),
                  pp=int(os.environ["PP"]))
node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
line = (f"layout: node {node} node_rank {os.environ['GROUP_RANK']} local_rank {os.environ['LOCAL_RANK']} "
        f"{p.describe()}")
rows = [None] * p.world_size
dist.all_gather_object(rows, (p.rank, node, line))
if p.rank == 0:
    rows.sort()
    split = [g for g in group_ranks(*p.sizes)["mp"] if len({rows[r][1] for r in g}) > 1]
    text = "\n".join(r[2] for r in rows) + "\n"
    if split:
        text += f"warning: model-parallel groups span nodes: {split}\n"
    write_text_atomic(os.environ["LAYOUT_FILE"], text)
    print(text, end="", flush=True)
dist.destroy_process_group()
PY
preflight_cmd=("$PYTHON" -m torch.distributed.run "${rdzv[@]}" --rdzv-id="$JOB_ID-preflight" --max-restarts=0
  --no-python "$PYTHON" -c "$PREFLIGHT_PY")

quoted() { printf '%q ' "$@" | sed 's/ $//'; }
# The variables set above for every rank, as NAME=value words (shell-quoted).
env_names=(OMP_NUM_THREADS NCCL_DEBUG TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_FR_BUFFER_SIZE TORCH_NCCL_DUMP_ON_TIMEOUT
  TORCH_FR_DUMP_TEMP_FILE TORCH_DISABLE_SHARE_RDZV_TCP_STORE PET_SIGNALS_TO_HANDLE)
env_assignments() { for name in "${env_names[@]}"; do printf '%s=%q ' "$name" "${!name}"; done | sed 's/ $//'; }

# The mesh table, then the config with every override: bad sizes or keys fail here, in one process
# on one node, before any rank starts.
check() {
  "$PYTHON" - "$CONFIG" "${train_overrides[@]}" <<'PY'
import os, sys
from hybridpar.cli import main
from hybridpar.config import ConfigError, find_config, load_config
if main(os.environ["MESH_ARGS"].split()) != 0:
    sys.exit("slurm.sh: error: these sizes do not tile the job (see above)")
try:
    load_config(find_config(sys.argv[1]), sys.argv[2:])
except ConfigError as err:
    sys.exit(f"slurm.sh: error: config: {err}")
PY
}

describe() {
  echo "hybridpar on Slurm: $NODES nodes x $PROCS_PER_NODE processes = $WORLD ranks," \
    "mp $MP x${CP_WORD:+ cp $CP x}${PP_WORD:+ pp $PP x} dp_shard $DP_SHARD x dp_replicate $DP_REPLICATE, config $CONFIG"
  echo "rendezvous: c10d at $RDZV_HOST:$RDZV_PORT; up to $MAX_RESTARTS restarts from the newest checkpoint"
  echo "run folder: $RUN_DIR (checkpoints/ and this job's job-$JOB_ID/)"
  echo "env: $(env_assignments)"
  echo "srun: $(quoted "${srun_cmd[@]}")"
  echo "torchrun: $(quoted "${torchrun_cmd[@]}")"
  echo "mesh: $(quoted "${mesh_cmd[@]}")"
}

if ((FT)); then  # replica groups (torchft): launch/slurm_ft.sh beside this script's original, or in the submit folder
  for ft in "$(dirname -- "${BASH_SOURCE[0]}")" "${HYBRIDPAR_HOME:-${SLURM_SUBMIT_DIR:-.}}/launch"; do [[ -f $ft/slurm_ft.sh ]] && break; done
  source "$ft/slurm_ft.sh" || die "launch/slurm_ft.sh not found: submit from the repository root or set HYBRIDPAR_HOME"
fi
if [[ $DRY_RUN == 1 ]]; then
  echo "dry run: nothing is started"
  describe
  check
  if [[ $REHEARSE == 1 ]]; then
    # The real model building, sharding and one step, as one rank of the whole world (no GPU needed).
    rehearsal=("$PYTHON" -m hybridpar train --dry-run --world "$WORLD" --dry-run-rank "$DRY_RUN_RANK"
      --gpus-per-node "$PROCS_PER_NODE" --config "$CONFIG" "${train_overrides[@]}")
    [[ -n $DRY_RUN_JSON ]] && rehearsal+=(--json "$DRY_RUN_JSON")
    [[ -n $DRY_RUN_GPU ]] && rehearsal+=(--gpu "$DRY_RUN_GPU")
    echo "rehearsal: $(quoted "${rehearsal[@]}")"
    exec "${rehearsal[@]}"
  fi
  exit 0
fi

# --- the job ----------------------------------------------------------------------------------------
mkdir -p "$JOB_DIR/flight_recorder" "$CKPT_DIR"
# Everything this job prints also goes to job.log in its folder.
exec > >(tee -a "$JOB_DIR/job.log") 2>&1
tee_pid=$!
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT

describe
check
{
  echo "#!/usr/bin/env bash"
  echo "# job $JOB_ID: what launch/slurm.sh ran, with its environment"
  echo "export $(env_assignments)"
  echo "$(quoted "${srun_cmd[@]}") \\"
  echo "  $(quoted "${torchrun_cmd[@]}")"
} >"$JOB_DIR/command.sh"

# --- after a node's fault: exclude it and requeue -------------------------------------------------
report=$JOB_DIR/hang_report.json  # the watchdog's verdict, with the node it blames (node_fault)
incidents() { "$PYTHON" -m hybridpar.cli.incidents_command "$@"; }
verdict_id() { [[ -f $report ]] && stat -c '%i %Y' "$report" 2>/dev/null; }

# The partition's nodes that can run a job (not down, drained or failing, and responding).
usable_nodes() {
  sinfo -h -N -p "${SLURM_JOB_PARTITION:-}" -o '%N %t' 2>/dev/null | while read -r node state; do
    [[ $state == *'*' ]] && continue
    case ${state%[~#!%$@^-]} in idle | alloc | mix | comp | planned) echo "$node" ;; esac
  done | sort -u | paste -sd, -
}
excluded_nodes() {
  local list
  list=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
  [[ -z $list || $list == "(null)" ]] || scontrol show hostnames "$list" | paste -sd, -
}

# What to do about the newest verdict: sets $action ($fault_nodes, $why). $1: restarts torchrun has left.
decide() {
  local out
  out=$(incidents decide "$INCIDENTS" "$report" --job "$JOB_ID" --exclude-on-fault "$EXCLUDE_ON_FAULT" \
    --max-requeues "$MAX_REQUEUES" --max-restarts "$1" --needed "$NODES" --usable "$(usable_nodes)" \
    --excluded "$(excluded_nodes)") || { action=none; why="could not read $report"; return; }
  read -r action fault_nodes why <<<"$out"
  echo "slurm.sh: verdict: $action ${fault_nodes/-/} ($why)"
}

# Back in the queue without the faulty node; the next start resumes from the newest checkpoint.
requeue_without() {
  local exclude
  exclude=$(scontrol show hostlist "$(printf '%s\n' "$(excluded_nodes)" "$1" | tr ',' '\n' | grep . | sort -u | paste -sd, -)")
  incidents note "$INCIDENTS" event=requeue "job=$JOB_ID" "excluded=$exclude"
  echo "slurm.sh: excluding $exclude and requeueing job $JOB_ID (starts again in ${REQUEUE_DELAY} s at the earliest)"
  trap '' TERM  # the requeue ends this script with SIGTERM: the update below must still be made
  scontrol requeue "$JOB_ID" || die "scontrol requeue $JOB_ID failed: resubmit with --exclude $exclude"
  # A pending job only: ExcNodeList cannot change while it runs. Slurm holds a requeued job back for
  # its credential lifetime unless its start time is already set later than now.
  scontrol update JobId="$JOB_ID" ExcNodeList="$exclude" StartTime="now+$REQUEUE_DELAY" ||
    echo "slurm.sh: warning: could not exclude $exclude from job $JOB_ID" >&2
}

# What decide() said: requeue without the node (this script then ends), or record why not.
act() {
  case $action in
    exclude)
      requeue_without "$fault_nodes"
      exit 0 ;;
    stop)
      incidents note "$INCIDENTS" event=stop "job=$JOB_ID" "why=$why"
      echo "slurm.sh: not requeued: $why" >&2 ;;
  esac
}

# Ends the training step now: its ranks may be stopped or hung, and torchrun would restart them on
# the node at fault. Two interrupts within a second make srun kill every task.
end_step() {
  kill -INT "$1" 2>/dev/null || return 0
  sleep 0.5
  kill -INT "$1" 2>/dev/null || true
}

if [[ $PREFLIGHT == 1 ]]; then
  echo "preflight: every rank joins the mesh"
  if ! "${srun_cmd[@]}" "${preflight_cmd[@]}" 2>&1 | tee "$JOB_DIR/preflight.log"; then
    # One node whose task failed on its own (the others' were ended by --kill-on-bad-exit) is that
    # node's fault; several failing alike are the program's.
    mapfile -t failed < <(sed -n 's/^srun: error: \([^:]*\): tasks\{0,1\} [0-9,-]*: Exited with exit code.*/\1/p' \
      "$JOB_DIR/preflight.log" | sort -u)
    if ((${#failed[@]} == 1)); then
      printf '{"reason": "the preflight failed on node %s", "step": 0, "time": %s, "quiet_s": 0, "attempt": 0, "node_fault": {"kind": "preflight", "nodes": ["%s"], "ranks": []}}\n' \
        "${failed[0]}" "$(date +%s.%N)" "${failed[0]}" >"$report"
      decide 0
      act
    fi
    die "preflight failed: the ranks could not form the mesh (see above)"
  fi
fi
echo "training: $(date -u +%FT%TZ)"
stopped=$JOB_DIR/stopped.json  # written by rank 0 when the run stopped on a signal and saved
rm -f "$stopped"
seen=$(verdict_id || true)  # a verdict of an earlier start of this job is not this one's
status=0 action=""
if ((FT)); then ft_job; else  # the lighthouse and the groups: launch/slurm_ft.sh
  "${srun_cmd[@]}" "${torchrun_cmd[@]}" &
  srun_pid=$!
  while kill -0 "$srun_pid" 2>/dev/null; do
    id=$(verdict_id || true)
    if [[ -n $id && $id != "$seen" ]]; then
      seen=$id
      decide "$MAX_RESTARTS"
      if [[ $action == exclude || $action == stop ]]; then  # torchrun would restart on that node
        end_step "$srun_pid"
        break
      fi
    fi
    sleep 1
  done
  wait "$srun_pid" || status=$?
  id=$(verdict_id || true)
  if [[ $action != exclude && $action != stop && -n $id && $id != "$seen" ]]; then
    decide 0  # a verdict as the step ended (a death, a straggler's stop): torchrun restarts no more
  fi
fi
act
if [[ -f $stopped ]]; then
  echo "stopped on a signal and saved: $(tr -d '\n' <"$stopped")"
  if [[ $REQUEUE == 1 && -n ${SLURM_JOB_ID:-} ]]; then
    # Back in the queue under the same job id: the next start resumes from that checkpoint.
    trap '' TERM  # the requeue ends this script with SIGTERM: let it say so first
    scontrol requeue "$SLURM_JOB_ID" && echo "requeued job $SLURM_JOB_ID: it resumes from the checkpoint when it starts again"
  fi
  exit 0
fi
if ((status == 0)); then
  echo "done: checkpoints in $CKPT_DIR, logs and metrics in $JOB_DIR"
else
  echo "slurm.sh: training failed with exit code $status; logs in $JOB_DIR (torchrun/ has each rank's output)" >&2
fi
[[ -f $INCIDENTS ]] && { echo "incidents of this run ($INCIDENTS):"; incidents summary "$INCIDENTS"; }
exit "$status"
