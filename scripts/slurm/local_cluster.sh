#!/usr/bin/env bash
# A real SLURM cluster of N "nodes" on this one machine, on loopback only (slurm-wlm 22.05,
# Debian bookworm, root): munge with a generated key, slurmctld, and one `slurmd -N nI` per
# node, all files in one folder. For trying scripts/slurm/train.sbatch and for CI.
#
#   bash scripts/slurm/local_cluster.sh up [N]      # N nodes n1..nN (default 2); last line: SLURM_CONF=...
#   export SLURM_CONF=...                           # then sinfo / sbatch / squeue as usual
#   bash scripts/slurm/local_cluster.sh slurmd NODE # (re)start one node's slurmd (after a kill)
#   bash scripts/slurm/local_cluster.sh down        # cancel jobs, stop every daemon by its pid
#
# The folder is LOCAL_SLURM_DIR (default /tmp/tide-local-slurm); ports LOCAL_SLURM_PORT
# (slurmctld, default 17000) and the next N (slurmd of n1..nN: 17001, 17002, ...). `up` stops
# a cluster already running from that folder first, so a second `up` leaves no strays.
# Missing packages (slurmd slurmctld slurm-client munge) are installed with apt-get.
# Exit status: 0 up / down; 3 this machine cannot host one (not root, no apt-get, install
# failed): tests skip on 3 only; 1 the cluster did not come up (logs printed).
set -euo pipefail

DIR="${LOCAL_SLURM_DIR:-/tmp/tide-local-slurm}"
PORT="${LOCAL_SLURM_PORT:-17000}"
CONF="$DIR/slurm.conf"
PACKAGES=(slurmd slurmctld slurm-client munge)
COMMANDS=(slurmd slurmctld sinfo munged)
UP_TIMEOUT_S="${LOCAL_SLURM_UP_TIMEOUT_S:-60}"

say() { echo "local_cluster.sh: $*" >&2; }
cannot() { say "cannot start a cluster: $*"; exit 3; }
fail() { say "error: $*"; exit 1; }

alive() {  # pid: running and not a zombie
    local state
    state="$(awk '{print $3}' "/proc/$1/stat" 2> /dev/null)" || return 1
    [[ -n "$state" && "$state" != Z ]]
}

install_packages() {
    local missing=()
    for cmd in "${COMMANDS[@]}"; do
        command -v "$cmd" > /dev/null || PATH="$PATH:/usr/sbin:/sbin" command -v "$cmd" > /dev/null \
            || missing+=("$cmd")
    done
    [[ ${#missing[@]} == 0 ]] && return 0
    [[ "$(id -u)" == 0 ]] || cannot "${missing[*]} not installed and not root (apt-get needs root)"
    command -v apt-get > /dev/null || cannot "${missing[*]} not installed and no apt-get here; install ${PACKAGES[*]} (slurm-wlm 22.05+)"
    say "installing ${PACKAGES[*]} (apt-get update + install)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "${PACKAGES[@]}"; } > "${TMPDIR:-/tmp}/local_cluster_apt.log" 2>&1; then
        tail -20 "${TMPDIR:-/tmp}/local_cluster_apt.log" >&2
        cannot "apt-get install ${PACKAGES[*]} failed (log: ${TMPDIR:-/tmp}/local_cluster_apt.log)"
    fi
}

start() {  # name command...: run detached, in its own session; pid to $DIR/pids/name
    local name="$1"
    shift
    SLURM_CONF="$CONF" setsid "$@" < /dev/null > "$DIR/log/$name.out" 2>&1 &
    echo "$!" > "$DIR/pids/$name"
}

stop_pid_files() {  # SIGTERM every recorded daemon, SIGKILL after 10 s
    local files=("$DIR"/pids/*) pids=() pid
    [[ -e "${files[0]}" ]] || return 0
    for file in "${files[@]}"; do
        pid="$(cat "$file")"
        if alive "$pid"; then
            kill -TERM "$pid" 2> /dev/null || true
            pids+=("$pid")
        fi
    done
    for _ in $(seq 100); do
        local left=()
        for pid in "${pids[@]}"; do alive "$pid" && left+=("$pid"); done
        [[ ${#left[@]} == 0 ]] && break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do
        alive "$pid" && { say "pid $pid ignored SIGTERM for 10 s: SIGKILL"; kill -KILL "$pid" 2> /dev/null || true; }
    done
    rm -f "${files[@]}"
}

cluster_steps() {  # slurmstepd processes started by this cluster's slurmd (their environment holds SLURM_CONF=$CONF)
    local proc
    for proc in /proc/[0-9]*; do
        [[ "$(cat "$proc/comm" 2> /dev/null)" == slurmstepd ]] || continue
        tr '\0' '\n' < "$proc/environ" 2> /dev/null | grep -qx "SLURM_CONF=$CONF" && echo "${proc#/proc/}"
    done
    return 0
}

descendants() {  # pids: every process below them (parent pids from /proc/*/stat)
    local -A children=()
    local proc stat fields pid todo=("$@") out=()
    for proc in /proc/[0-9]*; do
        stat="$(cat "$proc/stat" 2> /dev/null)" || continue
        read -r -a fields <<< "${stat##*) }"  # state, parent pid, ...
        children[${fields[1]}]+=" ${proc#/proc/}"
    done
    while [[ ${#todo[@]} -gt 0 ]]; do
        pid="${todo[0]}"
        todo=("${todo[@]:1}")
        for child in ${children[$pid]:-}; do
            out+=("$child")
            todo+=("$child")
        done
    done
    echo "${out[*]}"
}

down() {
    [[ -d "$DIR/pids" ]] || { say "no cluster in $DIR"; return 0; }
    local ctld
    ctld="$(cat "$DIR/pids/slurmctld" 2> /dev/null || true)"
    if [[ -n "$ctld" ]] && alive "$ctld"; then
        local jobs
        jobs="$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2> /dev/null || true)"
        if [[ -n "$jobs" ]]; then
            say "cancelling job(s) $(echo $jobs)"
            SLURM_CONF="$CONF" timeout 10 scancel $jobs 2> /dev/null || true
            for _ in $(seq 30); do
                [[ -z "$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2> /dev/null || true)" ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_pid_files
    local strays
    strays="$(cluster_steps)"
    if [[ -n "$strays" ]]; then  # a job's step daemons outlive slurmd: end them and their tasks
        local tasks
        tasks="$(descendants $strays)"
        say "ending slurmstepd $(echo $strays) of this cluster${tasks:+ and their processes $tasks}"
        kill -KILL $strays $tasks 2> /dev/null || true
    fi
    rmdir "$DIR/pids" 2> /dev/null || true
    say "stopped the cluster in $DIR"
}

write_conf() {
    local nodes="$1" host
    host="$(uname -n)"
    host="${host%%.*}"
    {
        echo "# local_cluster.sh: $nodes node(s) on loopback, generated $(date -u +%FT%TZ)"
        echo "ClusterName=tidelocal"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$PORT"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # cred_expire (SLURM's default 120 s): a requeued job starts again only after it. Not
        # below ~70 s: slurmctld retries its kill of the failed attempt on a DOWN node every
        # 60 s (RPC_RETRY_INTERVAL), and a retry that reaches the node once it is back kills
        # the next attempt if that one already runs there (the job id is the same).
        echo "AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=90"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SchedulerType=sched/backfill"
        echo "SchedulerParameters=bf_interval=5"  # a job whose begin time passed starts within 5 s
        echo "MpiDefault=none"
        echo "MailProg=/bin/true"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        # A node that stops answering is DOWN after SlurmdTimeout; one that registers again
        # comes back by itself (ReturnToService=2). KillWait: SIGTERM to SIGKILL on scancel.
        echo "SlurmdTimeout=10"
        echo "ReturnToService=2"
        echo "KillWait=10"
        echo "MinJobAge=300"
        echo "InactiveLimit=0"
        for ((i = 1; i <= nodes; i++)); do
            echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$(nproc) State=UNKNOWN"
        done
        echo "PartitionName=local Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP"
    } > "$CONF"
}

start_slurmd() {  # node name: (re)start its slurmd
    local node="$1" old
    old="$(cat "$DIR/pids/slurmd-$node" 2> /dev/null || true)"
    if [[ -n "$old" ]] && alive "$old"; then
        kill -TERM "$old" 2> /dev/null || true
        for _ in $(seq 50); do alive "$old" || break; sleep 0.1; done
    fi
    mkdir -p "$DIR/spool/$node"
    start "slurmd-$node" slurmd -D -f "$CONF" -N "$node"
}

wait_idle() {  # every node idle, else the logs and exit 1
    local nodes="$1" states=""
    for _ in $(seq $((UP_TIMEOUT_S * 2))); do
        states="$(SLURM_CONF="$CONF" timeout 10 sinfo -h -N -o '%N %t' 2> /dev/null || true)"
        [[ "$(grep -c ' idle$' <<< "$states")" == "$nodes" ]] && return 0
        sleep 0.5
    done
    say "error: nodes not idle after ${UP_TIMEOUT_S} s; sinfo:"
    echo "${states:-(no answer from slurmctld)}" >&2
    for log in "$DIR"/log/*; do
        echo "--- $log" >&2
        tail -8 "$log" >&2
    done
    down
    exit 1
}

up() {
    local nodes="${1:-2}"
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || fail "N must be a positive integer (nodes), got '$nodes'"
    [[ "$(id -u)" == 0 ]] || cannot "must run as root (slurmd starts job steps as their user)"
    install_packages
    export PATH="$PATH:/usr/sbin:/sbin"
    [[ -d "$DIR/pids" ]] && down
    rm -rf "$DIR"
    mkdir -p "$DIR"/{pids,log,run,state,spool,munge}
    chmod 700 "$DIR/munge"
    head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    write_conf "$nodes"
    start munged munged -F --force --key-file="$DIR/munge/munge.key" \
        --socket="$DIR/munge/munge.socket" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
    for _ in $(seq 50); do [[ -S "$DIR/munge/munge.socket" ]] && break; sleep 0.1; done
    [[ -S "$DIR/munge/munge.socket" ]] || { tail "$DIR/log/munged.out" "$DIR/log/munged.log" >&2 || true; down; fail "munged did not start"; }
    start slurmctld slurmctld -D -i -f "$CONF"
    for ((i = 1; i <= nodes; i++)); do start_slurmd "n$i"; done
    wait_idle "$nodes"
    say "$nodes node(s) idle: $(SLURM_CONF="$CONF" sinfo -h -o '%P %D %t %N' | tr '\n' ' ')(folder $DIR)"
    echo "SLURM_CONF=$CONF"
}

case "${1:-}" in
    up) up "${2:-2}" ;;
    down) down ;;
    slurmd)
        [[ -n "${2:-}" && -f "$CONF" ]] || fail "usage: local_cluster.sh slurmd NODE (with a cluster up in $DIR)"
        export PATH="$PATH:/usr/sbin:/sbin"
        start_slurmd "$2"
        ;;
    *) fail "usage: local_cluster.sh up [N] | down | slurmd NODE" ;;
esac
