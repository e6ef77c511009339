#!/usr/bin/env bash
# Emulated nodes on ONE GPU: N launcher "nodes" of one rank each, all on the same GPU, each
# running ./run_train.sh with its own NODE_RANK (docs/design/2026-12-02-emulation.md).
#
#   scripts/gpu/emulate.sh [--nodes N] [--mode nodes|one_node] [--grace S] [--dry-run] \
#       [--] --config debug_model --tide.comm tide [more run_train.sh arguments]
#
#   --nodes N     emulated nodes (default 2), one rank each (NGPU=1)
#   --mode nodes  (default) every node its own NCCL node: NCCL_HOSTID=emunode<i>, NCCL's
#                 socket transport on loopback (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1);
#                 works with the NCCL torch bundles
#   --mode one_node  NCCL sees ONE node whose ranks share the GPU
#                 (NCCL_MULTI_RANK_GPU_ENABLE=1, no host ids); needs NCCL >= 2.30 in torch's
#                 place (scripts/gpu/nccl_swap.sh); TIDE still sees one node per launcher
#   --grace S     once a node fails, seconds the others get to end by themselves before
#                 they are stopped (default 10; a cluster's scheduler ends the job step
#                 the same way: SLURM's --kill-on-bad-exit)
#   --dry-run     print each node's command (environment and arguments), start nothing
#
# Output lines are prefixed "[node i] ". Exit status: 0 when every node exited 0, else the
# first non-zero status. Timings from here are no cluster figures: the ranks share one GPU
# and "the network" is a loopback socket (about 1.7 GiB/s).
# Environment: MASTER_PORT (default: a free port), EMULATE_GPU (default: the first of
# CUDA_VISIBLE_DEVICES, else 0), PYTHON (default python3).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
nodes=2 mode=nodes grace=10 dry_run=0

usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
die() { echo "emulate.sh: error: $*" >&2; exit 2; }

while (($#)); do
  case "$1" in
    --nodes) nodes="${2:-}"; shift 2 || die "--nodes needs a value" ;;
    --nodes=*) nodes="${1#*=}"; shift ;;
    --mode) mode="${2:-}"; shift 2 || die "--mode needs a value" ;;
    --mode=*) mode="${1#*=}"; shift ;;
    --grace) grace="${2:-}"; shift 2 || die "--grace needs a value" ;;
    --grace=*) grace="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes $nodes: a positive integer, e.g. --nodes 2"
[[ "$grace" =~ ^[0-9]+$ ]] || die "--grace $grace: whole seconds, e.g. --grace 10"
[[ "$mode" == nodes || "$mode" == one_node ]] || die "--mode $mode: choose nodes or one_node"
(($#)) || die "no run_train.sh arguments; e.g. scripts/gpu/emulate.sh --nodes 2 -- --config debug_model --tide.comm tide"

gpu="${EMULATE_GPU:-${CUDA_VISIBLE_DEVICES:-0}}"
gpu="${gpu%%,*}"
port="${MASTER_PORT:-}"
if [[ -z "$port" ]]; then
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
    || die "could not pick a free port; set MASTER_PORT"
fi

# node_env I: the variables of emulated node I, one NAME=VALUE a line (the same as
# tests/comm/_emulation.py's emulated_env plus the launcher's; a CPU test compares them).
node_env() {
  echo NCCL_SOCKET_IFNAME=lo
  echo NCCL_IB_DISABLE=1
  if [[ "$mode" == nodes ]]; then
    echo "NCCL_HOSTID=emunode$1"
  else
    echo NCCL_MULTI_RANK_GPU_ENABLE=1
  fi
  echo "NNODES=$nodes"
  echo "NODE_RANK=$1"
  echo NGPU=1
  echo "CUDA_VISIBLE_DEVICES=$gpu"
  echo MASTER_ADDR=127.0.0.1
  echo "MASTER_PORT=$port"
}

# node_command I: the command of node I (env -u: no host id leaks into one_node mode).
node_command() {
  local -a vars
  mapfile -t vars < <(node_env "$1")
  cmd=(env -u NCCL_HOSTID -u NCCL_MULTI_RANK_GPU_ENABLE "${vars[@]}" "$REPO/run_train.sh" "${run_args[@]}")
}

run_args=("$@")
if ((dry_run)); then
  for ((i = 0; i < nodes; i++)); do
    node_command "$i"
    printf '[emulate] node %d:' "$i"; printf ' %q' "${cmd[@]}"; echo
  done
  exit 0
fi

if [[ "$mode" == one_node ]]; then
  why=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
    'from torchtitan_tide.comm.transports.windows.nccl_rma import multi_rank_gpu_missing_reason as r; print(r() or "")') \
    || die "could not read the NCCL version (torch import failed)"
  [[ -z "$why" ]] || die "--mode one_node: $why"
fi

# descendants PID...: every process below the given ones (torchrun's workers run in
# sessions of their own, so process groups do not reach them).
descendants() {
  local -a todo=("$@") out=()
  local table="" pid ppid child stat line rest
  for stat in /proc/[0-9]*/stat; do  # "pid ppid" lines from /proc (no ps needed)
    { read -r line < "$stat"; } 2>/dev/null || continue
    rest=${line##*) }
    read -r _ ppid _ <<< "$rest"
    pid=${stat#/proc/}
    table+="${pid%/stat} $ppid"$'\n'
  done
  while ((${#todo[@]})); do
    pid=${todo[-1]}; unset 'todo[-1]'
    for child in $(awk -v p="$pid" '$2 == p {print $1}' <<< "$table"); do
      out+=("$child"); todo+=("$child")
    done
  done
  echo "${out[@]}"
}

# stop PID...: SIGTERM the given subshells' processes (torchrun's agents stop their
# workers), SIGKILL whatever is left after 10 s (a stopped worker never acts on SIGTERM).
stop() {
  local -a procs
  read -r -a procs <<< "$(descendants "$@")"
  ((${#procs[@]})) || return 0
  kill -TERM "${procs[@]}" 2>/dev/null
  for _ in $(seq 20); do
    kill -0 "${procs[@]}" 2>/dev/null || break
    sleep 0.5
  done
  read -r -a procs <<< "$(descendants "$@") ${procs[*]}"
  kill -KILL "${procs[@]}" 2>/dev/null
  return 0
}

declare -a pids status
# before the first node starts: an interrupt during start-up stops the ones already running
trap 'echo "[emulate] interrupted: stopping every node"; stop "${pids[@]}"; exit 130' INT TERM
for ((i = 0; i < nodes; i++)); do
  node_command "$i"
  echo "[emulate] node $i: ${cmd[*]}"
  (
    "${cmd[@]}" 2>&1 | sed -u "s/^/[node $i] /"
    exit "${PIPESTATUS[0]}"
  ) &
  pids[i]=$!
done

first_failure="" first_rc=0 stopped=0
while :; do
  running=0
  for ((i = 0; i < nodes; i++)); do
    [[ -n "${status[i]:-}" ]] && continue
    if kill -0 "${pids[i]}" 2>/dev/null; then
      running=1
      continue
    fi
    wait "${pids[i]}"
    status[i]=$?
    echo "[emulate] node $i exited with status ${status[i]}"
    if [[ "${status[i]}" != 0 && -z "$first_failure" ]]; then
      first_failure=$SECONDS first_rc=${status[i]}  # the first node to fail, in time
    fi
  done
  ((running)) || break
  if [[ -n "$first_failure" ]] && ((!stopped && SECONDS - first_failure >= grace)); then
    live=()
    for ((i = 0; i < nodes; i++)); do
      [[ -z "${status[i]:-}" ]] && live+=("${pids[i]}")
    done
    echo "[emulate] a node failed ${grace} s ago: stopping the others (${#live[@]} left)"
    stop "${live[@]}"
    kill -TERM "${live[@]}" 2>/dev/null
    stopped=1  # their statuses are collected above
  fi
  sleep 0.5
done

rc=$first_rc
echo "[emulate] $nodes node(s), mode $mode: statuses ${status[*]}, exit $rc"
exit "$rc"
