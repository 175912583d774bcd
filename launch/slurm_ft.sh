# launch/slurm.sh --ft (FT=1): replica groups that fail alone, through torchft. Sourced by slurm.sh
# once its settings and commands are made; not a job script of its own.
#
#   sbatch --nodes 4 --no-kill --gpus-per-node 8 launch/slurm.sh --ft --procs-per-node 8 --mp 8
#   FT=1 MP=2 PROCS_PER_NODE=2 sbatch --nodes 3 --no-kill launch/slurm.sh -- --train.steps 40   # CPU nodes
#
# The job's first node (where Slurm runs this script) runs `hybridpar lighthouse`; every GROUP_NODES
# nodes are one replica group, its own srun step and its own torchrun (its own rendezvous, up to
# MAX_RESTARTS restarts), a world of mp x cp x pp x dp_shard: the sizes are a group's, and the
# groups are the replicas (DP_REPLICATE stays 1). Submit with sbatch --no-kill: without it Slurm
# ends the whole job when one of its nodes fails. What the job does about a failure:
#   - a group's rank dies or hangs (or, over diagnostics.straggler_exclude, stops its group with exit
#     1): its torchrun restarts the group, which rejoins healed from a live group, while the others
#     train on; no requeue. A group whose torchrun has spent its
#     restarts (or whose node is lost) is out for the rest of this job; the others train on.
#   - every group gone before one finished: the newest group verdict decides as in a job without
#     --ft (a node's fault: excluded, the job requeued; anything else: the job fails).
#   - the lighthouse dies: no step can commit, so every group is ended and the job requeued
#     (REQUEUE=1, MAX_REQUEUES), to resume from the newest checkpoint.
#   - a stop on a signal (USR1 ahead of the time limit, a preemption): every group saves and the
#     job is requeued, as without --ft.
# Settings:
#   GROUP_NODES      nodes per replica group (1); it divides the job's nodes
#   MIN_GROUPS       the fewest groups that may commit a step (1): the lighthouse's --min-groups and
#                    fault_tolerance.min_groups
#   LIGHTHOUSE_PORT  the lighthouse's port on the first node (RDZV_PORT + the number of groups)
#   RDZV_HOST        by default group g meets on its own first node at RDZV_PORT + g; given, every
#                    group meets there (a cluster on one machine) and the lighthouse runs there
# Each group logs to job-<id>/group-<g>/ (its metrics, events, verdicts, torchrun/); its output in
# job.log is prefixed "group <g> ". Every group trains with the job's checkpoints.

((NODES % GROUP_NODES == 0)) ||
  die "GROUP_NODES=$GROUP_NODES does not divide the job's $NODES nodes: submit a multiple of it (sbatch --nodes)"
FT_GROUPS=$((NODES / GROUP_NODES))
MIN_GROUPS=${MIN_GROUPS:-1}
[[ $MIN_GROUPS =~ ^[0-9]+$ ]] && ((MIN_GROUPS >= 1 && MIN_GROUPS <= FT_GROUPS)) ||
  die "MIN_GROUPS must be in 1 .. $FT_GROUPS (the job's replica groups), got '$MIN_GROUPS'"
((DP_REPLICATE == 1)) || die "--ft: the $FT_GROUPS replica groups (of GROUP_NODES=$GROUP_NODES nodes) are the" \
  "replicas: DP_REPLICATE must be 1, got $DP_REPLICATE; for more replicas make more, smaller groups (GROUP_NODES)"
# The preflight joins every rank of the job in one mesh, the groups standing as dp_replicate: it checks
# every node and the network between them, which the groups' all-reduce crosses.
preflight_cmd=(env DP_REPLICATE="$FT_GROUPS" "${preflight_cmd[@]}")
export FT_GROUPS  # the ranks' summary prints the command that starts the job again

if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  mapfile -t ft_nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  ft_nodes=("$RDZV_HOST")  # a dry run outside a job: this machine, node1, node2, ... stand for the nodes
  for ((k = 1; k < NODES; k++)); do ft_nodes+=("node$k"); done
fi
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-$((RDZV_PORT + FT_GROUPS))}
LIGHTHOUSE=http://$RDZV_HOST:$LIGHTHOUSE_PORT
lighthouse_cmd=("$PYTHON" -m hybridpar lighthouse --port "$LIGHTHOUSE_PORT" --min-groups "$MIN_GROUPS")
group_nodes=()  # each group's nodes, comma-separated
for ((g = 0; g < FT_GROUPS; g++)); do
  group_nodes+=("$(IFS=,; echo "${ft_nodes[*]:g * GROUP_NODES:GROUP_NODES}")")
done
# Every group's keys but its index, after the user's overrides: the config check and the rehearsal see them.
train_overrides+=(--fault_tolerance.enabled true --fault_tolerance.groups "$FT_GROUPS"
  --fault_tolerance.min_groups "$MIN_GROUPS" --fault_tolerance.lighthouse "$LIGHTHOUSE")

# Group $1's srun and torchrun (group_srun, group_torchrun, group_endpoint): the job's commands on its
# own nodes (srun --relative: the allocation's nodes in order; srun_cmd's per-node flags after its
# sizes), its own rendezvous and folder, and its index last.
group_commands() {
  local g=$1
  group_endpoint=${RDZV_GIVEN:-${group_nodes[g]%%,*}}:$((RDZV_PORT + g))
  group_srun=(srun --nodes="$GROUP_NODES" --ntasks="$GROUP_NODES" --relative=$((g * GROUP_NODES)) "${srun_cmd[@]:3}")
  group_torchrun=("$PYTHON" -m torch.distributed.run --nnodes="$GROUP_NODES" --nproc-per-node="$PROCS_PER_NODE"
    --rdzv-backend=c10d --rdzv-endpoint="$group_endpoint" --rdzv-id="$JOB_ID-group$g" --max-restarts="$MAX_RESTARTS"
    --log-dir="$JOB_DIR/group-$g/torchrun" --tee=3
    -m hybridpar train --config "$CONFIG" "${train_overrides[@]}" --fault_tolerance.group "$g")
}

describe() {
  echo "hybridpar on Slurm, fault tolerant: $FT_GROUPS replica groups of $GROUP_NODES node(s) x $PROCS_PER_NODE" \
    "processes = $WORLD ranks, each mp $MP x${CP_WORD:+ cp $CP x}${PP_WORD:+ pp $PP x} dp_shard $DP_SHARD, config $CONFIG"
  echo "lighthouse: $(quoted "${lighthouse_cmd[@]}") on the first node, at $LIGHTHOUSE"
  echo "run folder: $RUN_DIR (checkpoints/ and this job's job-$JOB_ID/, a group-<g>/ per group)"
  echo "env: $(env_assignments)"
  for ((g = 0; g < FT_GROUPS; g++)); do
    group_commands "$g"
    echo "group $g: nodes ${group_nodes[g]}; rendezvous c10d at $group_endpoint; up to" \
      "$MAX_RESTARTS restarts, healed from a live group, while the others train on"
    echo "group $g srun: $(quoted "${group_srun[@]}")"
    echo "group $g torchrun: $(quoted "${group_torchrun[@]}")"
  done
  echo "mesh: $(quoted "${mesh_cmd[@]}")"
}

# Back in the queue as it is ($1: why): the next start resumes from the newest checkpoint.
ft_requeue() {
  local requeues
  requeues=$(grep -c "\"event\":\"requeue\",\"job\":\"$JOB_ID\"" "$INCIDENTS" 2>/dev/null || true)
  if [[ $REQUEUE != 1 || -z ${SLURM_JOB_ID:-} ]] || ((${requeues:-0} >= MAX_REQUEUES)); then
    echo "slurm.sh: not requeued: $1 (REQUEUE=$REQUEUE; requeued ${requeues:-0} times, MAX_REQUEUES=$MAX_REQUEUES)" >&2
    incidents note "$INCIDENTS" event=stop "job=$JOB_ID" "why=$1"
    return
  fi
  incidents note "$INCIDENTS" event=requeue "job=$JOB_ID" "why=$1"
  echo "slurm.sh: requeueing job $JOB_ID: $1 (starts again in ${REQUEUE_DELAY} s at the earliest)"
  trap '' TERM  # the requeue ends this script with SIGTERM: the update below must still be made
  scontrol requeue "$JOB_ID" || die "scontrol requeue $JOB_ID failed: resubmit the job"
  scontrol update JobId="$JOB_ID" StartTime="now+$REQUEUE_DELAY" || true
  exit 0
}

# Ends the groups still running ($@: their indexes; ended[] remembers them) and waits for them.
ft_end() {
  local g
  for g in "$@"; do ended[g]=1; end_step "${pids[g]}"; done
  for g in "$@"; do wait "${pids[g]}" 2>/dev/null || true; done
}

# The groups that ended since the last look: each said, and counted in finished / left.
ft_reap() {
  local g
  for g in "${!pids[@]}"; do
    [[ -n ${codes[g]:-} ]] || kill -0 "${pids[g]}" 2>/dev/null && continue
    codes[g]=0
    wait "${pids[g]}" || codes[g]=$?
    live=$((live - 1))
    if ((codes[g] == 0)); then
      finished=$((finished + 1)) done_at=${done_at:-$SECONDS}
      echo "slurm.sh: replica group $g (${group_nodes[g]}) finished"
    elif [[ -z ${ended[g]:-} ]]; then
      lost+=("$g (${group_nodes[g]})")
      echo "slurm.sh: replica group $g (${group_nodes[g]}) is gone (exit code ${codes[g]}: its restarts are spent" \
        "or its node is lost); $live group(s) still running" >&2
      incidents note "$INCIDENTS" event=group_gone "job=$JOB_ID" "group=$g" "nodes=${group_nodes[g]}" "exit=${codes[g]}"
    fi
  done
}

# The lighthouse, the groups, and what they say until every group has ended; then sets what
# slurm.sh's end reads: status, action (from decide, when every group failed), stopped.
ft_job() {
  local g k running
  pids=() codes=() ended=() lost=() live=$FT_GROUPS finished=0 done_at=""
  rm -f "$JOB_DIR"/group-*/stopped.json
  "${lighthouse_cmd[@]}" >"$JOB_DIR/lighthouse.log" 2>&1 &
  lighthouse_pid=$! watch_pid=""  # (not local: the trap below runs when the script ends)
  trap 'kill "$lighthouse_pid" $watch_pid 2>/dev/null; exec >&- 2>&-; wait "$tee_pid"' EXIT
  for ((k = 0; k < 60; k++)); do  # torchft's import takes seconds
    grep -q '^hybridpar lighthouse:' "$JOB_DIR/lighthouse.log" && break
    kill -0 "$lighthouse_pid" 2>/dev/null || break
    sleep 1
  done
  grep '^hybridpar lighthouse:' "$JOB_DIR/lighthouse.log" ||
    die "the lighthouse did not start on port $LIGHTHOUSE_PORT (set LIGHTHOUSE_PORT): $(tail -n 3 "$JOB_DIR/lighthouse.log")"
  "$PYTHON" -m hybridpar.cli.incidents_command watch "$INCIDENTS" "$JOB_DIR" --job "$JOB_ID" \
    --max-restarts "$MAX_RESTARTS" --nodes "$(IFS=';'; echo "${group_nodes[*]}")" &
  watch_pid=$!
  {
    echo "#!/usr/bin/env bash"
    echo "# job $JOB_ID: what launch/slurm.sh --ft ran, with its environment"
    echo "export $(env_assignments)"
    echo "$(quoted "${lighthouse_cmd[@]}") &"
  } >"$JOB_DIR/command.sh"
  for ((g = 0; g < FT_GROUPS; g++)); do
    group_commands "$g"
    mkdir -p "$JOB_DIR/group-$g"
    echo "$(quoted "${group_srun[@]}") $(quoted "${group_torchrun[@]}") &" >>"$JOB_DIR/command.sh"
    "${group_srun[@]}" "${group_torchrun[@]}" > >(sed -u "s/^/group $g /") 2>&1 &
    pids+=($!)
  done
  while ((live > 0)); do
    ft_reap
    running=()
    for g in "${!pids[@]}"; do [[ -z ${codes[g]:-} ]] && running+=("$g"); done
    if ((finished == 0 && ${#running[@]})) && ! kill -0 "$lighthouse_pid" 2>/dev/null; then
      echo "slurm.sh: the lighthouse ($LIGHTHOUSE) died: no step can commit; ending every group" >&2
      ft_end "${running[@]}"
      status=1
      ft_requeue "the lighthouse died"
      return
    fi
    if ((finished == 0 && ${#running[@]} && ${#running[@]} < MIN_GROUPS)); then
      echo "slurm.sh: ${#running[@]} replica group(s) left, fewer than MIN_GROUPS=$MIN_GROUPS: no step can commit;" \
        "ending them" >&2
      ft_end "${running[@]}"
    fi
    # Training is done once a group finished: one still restarting then finds the last checkpoint and
    # ends in seconds; one stopped for good (a frozen node) is ended.
    if [[ -n $done_at ]] && ((${#running[@]} && SECONDS - done_at >= 60)); then
      echo "slurm.sh: replica group(s) ${running[*]} still running 60 s after the training finished: ending them" >&2
      ft_end "${running[@]}"
    fi
    sleep 1
  done
  kill "$watch_pid" 2>/dev/null && wait "$watch_pid" 2>/dev/null || true
  kill "$lighthouse_pid" 2>/dev/null || true
  ((${#lost[@]})) && echo "slurm.sh: replica groups lost in this job: ${lost[*]}"
  for g in "${!pids[@]}"; do  # a stop on a signal that a group saved (not one this script ended)
    [[ -z ${ended[g]:-} && -f $JOB_DIR/group-$g/stopped.json ]] && { stopped=$JOB_DIR/group-$g/stopped.json; break; }
  done
  ((finished > 0)) && return
  status=1
  report=$(ls -t "$JOB_DIR"/group-*/hang_report.json 2>/dev/null | head -n 1 || true)
  [[ -n $report ]] && decide 0  # every group failed: the newest verdict, as a job without --ft
  true
}
