#!/usr/bin/env bash
# Single-node Slurm test cluster on this host (for tests marked `slurm`).
#
#   .ci/slurm_cluster.sh start    install slurm-wlm + munge if missing, write
#                                 /etc/slurm/slurm.conf, start munged, slurmctld
#                                 and slurmd, wait until the node is idle
#   .ci/slurm_cluster.sh status   show the daemons and `sinfo`; exit 0 if usable
#   .ci/slurm_cluster.sh stop     cancel jobs, stop exactly the daemons `start`
#                                 started (pid files) and remove what it wrote
#
# All three commands are idempotent. Needs root (Debian/Ubuntu, apt-get).
#
# Environment (all optional):
#   SLURM_CI_DIR         state, spool, logs and pid files     [/var/tmp/slurm-ci]
#   SLURM_CI_CPUS        CPUs the node advertises; at least the real count, so
#                        a 4-task job fits on a 2-core machine [max(nproc, 4)]
#   SLURM_CI_PARTITION   partition name                        [debug]
#   SLURM_CI_TIMEOUT     seconds to wait for daemons/node      [90]
#   SLURM_CI_CTLD_PORT / SLURM_CI_SLURMD_PORT                  [6817 / 6818]
set -euo pipefail

CMD="${1:-}"
STATE_DIR="${SLURM_CI_DIR:-/var/tmp/slurm-ci}"
PARTITION="${SLURM_CI_PARTITION:-debug}"
TIMEOUT="${SLURM_CI_TIMEOUT:-90}"
CTLD_PORT="${SLURM_CI_CTLD_PORT:-6817}"
SLURMD_PORT="${SLURM_CI_SLURMD_PORT:-6818}"
CONF=/etc/slurm/slurm.conf
MARKER="# Written by .ci/slurm_cluster.sh (single-node test cluster)"
MUNGE_PID=/run/munge/munged.pid
NODE_NAME="$(hostname -s 2>/dev/null || hostname)"

log() { echo "[slurm_cluster] $*"; }
die() { echo "[slurm_cluster] ERROR: $*" >&2; exit 1; }

usage() {
    echo "usage: $0 start|stop|status" >&2
    exit 2
}

need_root() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (it installs packages and starts system daemons); try: sudo $0 $CMD"
}

pid_alive() {  # pid_alive <pidfile>: the pid in the file is a live process
    local f="$1" pid
    [[ -s "$f" ]] || return 1
    pid="$(tr -dc '0-9' <"$f")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

wait_until() {  # wait_until <seconds> <description> <command...>
    local secs="$1" what="$2"
    shift 2
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            return 1
        fi
        sleep 1
    done
    log "$what (after $((secs - (deadline - SECONDS)))s)"
}

show_logs() {
    local f
    for f in "$STATE_DIR"/log/*.log; do
        [[ -f "$f" ]] || continue
        echo "----- tail $f -----" >&2
        tail -n 20 "$f" >&2 || true
    done
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-wlm)
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    if ((${#missing[@]} == 0)); then
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "slurm-wlm/munge are not installed and apt-get is missing; install Slurm and MUNGE by hand"
    log "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq || die "apt-get update failed; check network access / apt sources"
    timeout 900 apt-get install -y -qq slurm-wlm munge >/dev/null ||
        die "apt-get install slurm-wlm munge failed; run it by hand to see why"
}

real_memory_mb() {
    awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo
}

write_conf() {
    local real_cpus cpus mem tmp
    real_cpus="$(nproc)"
    cpus="${SLURM_CI_CPUS:-$((real_cpus > 4 ? real_cpus : 4))}"
    [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die "SLURM_CI_CPUS='$cpus' is not a positive integer"
    mem="$(real_memory_mb)"
    if [[ -f "$CONF" ]] && ! grep -qF "$MARKER" "$CONF"; then
        die "$CONF exists and was not written by this script; move it away (or stop that cluster) first"
    fi
    mkdir -p /etc/slurm "$STATE_DIR"/{state,spool,log}
    tmp="$(mktemp)"
    cat >"$tmp" <<EOF
$MARKER
# Remove with: .ci/slurm_cluster.sh stop
ClusterName=ci
SlurmctldHost=${NODE_NAME}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=${STATE_DIR}/state
SlurmdSpoolDir=${STATE_DIR}/spool
SlurmctldPidFile=${STATE_DIR}/slurmctld.pid
SlurmdPidFile=${STATE_DIR}/slurmd.pid
SlurmctldLogFile=${STATE_DIR}/log/slurmctld.log
SlurmdLogFile=${STATE_DIR}/log/slurmd.log
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${STATE_DIR}/log/jobcomp.txt
MpiDefault=none
SchedulerType=sched/backfill
ReturnToService=2
# Trust the CPU count below even when it exceeds the cores of this host, so
# multi-task jobs fit on a small CI machine (tasks then share cores).
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=${NODE_NAME} NodeAddr=127.0.0.1 CPUs=${cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket=${cpus} ThreadsPerCore=1 RealMemory=${mem} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE_NAME} Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
EOF
    if [[ -f "$CONF" ]] && cmp -s "$tmp" "$CONF"; then
        rm -f "$tmp"
        return 0
    fi
    install -m 0644 "$tmp" "$CONF"
    rm -f "$tmp"
    log "wrote $CONF (node $NODE_NAME: $cpus CPUs on $real_cpus cores, ${mem} MB)"
}

start_munge() {
    if pid_alive "$MUNGE_PID"; then
        log "munged already running (pid $(cat "$MUNGE_PID"))"
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    runuser -u munge -- munged --pid-file="$MUNGE_PID" ||
        die "munged failed to start; see /var/log/munge/munged.log"
    wait_until 20 "munged up" munge -n || die "munged does not answer (munge -n); see /var/log/munge/munged.log"
    cp "$MUNGE_PID" "$STATE_DIR/munged.started"
}

start_daemon() {  # start_daemon slurmctld|slurmd
    local name="$1" pidfile="$STATE_DIR/$1.pid"
    if pid_alive "$pidfile"; then
        log "$name already running (pid $(cat "$pidfile"))"
        return 0
    fi
    "$name" || { show_logs; die "$name failed to start; log: $STATE_DIR/log/$name.log"; }
    wait_until 20 "$name up" pid_alive "$pidfile" ||
        { show_logs; die "$name did not write $pidfile; log: $STATE_DIR/log/$name.log"; }
    cp "$pidfile" "$STATE_DIR/$name.started"
}

node_state() {
    timeout 10 sinfo -h -N -n "$NODE_NAME" -o '%T' 2>/dev/null | head -n1
}

node_idle() {
    local s
    s="$(node_state)"
    [[ "$s" == idle* || "$s" == mixed* || "$s" == allocated* ]]
}

cmd_start() {
    need_root
    install_packages
    mkdir -p "$STATE_DIR"
    write_conf
    start_munge
    start_daemon slurmctld
    wait_until "$TIMEOUT" "slurmctld answers" timeout 10 scontrol ping ||
        { show_logs; die "slurmctld does not answer 'scontrol ping' within ${TIMEOUT}s"; }
    start_daemon slurmd
    if ! wait_until "$TIMEOUT" "node $NODE_NAME idle" node_idle; then
        local s
        s="$(node_state || true)"
        if [[ "$s" == drain* || "$s" == down* || "$s" == inval* ]]; then
            log "node is '$s', trying to resume it"
            scontrol update NodeName="$NODE_NAME" State=RESUME || true
            wait_until 20 "node $NODE_NAME resumed" node_idle && {
                sinfo
                return 0
            }
        fi
        show_logs
        scontrol show node "$NODE_NAME" >&2 || true
        die "node $NODE_NAME not idle after ${TIMEOUT}s (state '${s:-none}'); logs in $STATE_DIR/log"
    fi
    sinfo
}

stop_pidfile() {  # stop_pidfile <name> <pidfile-recorded-at-start>
    local name="$1" f="$2" pid
    [[ -s "$f" ]] || return 0
    pid="$(tr -dc '0-9' <"$f")"
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + 20))
        while kill -0 "$pid" 2>/dev/null; do
            if ((SECONDS >= deadline)); then
                log "$name (pid $pid) ignored SIGTERM for 20s, sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
                break
            fi
            sleep 0.5
        done
    fi
    rm -f "$f"
}

cmd_stop() {
    need_root
    if [[ -f "$STATE_DIR/slurmctld.started" ]] && pid_alive "$STATE_DIR/slurmctld.started"; then
        local jobs
        jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
        if [[ -n "$jobs" ]]; then
            log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
            # shellcheck disable=SC2086
            timeout 10 scancel $jobs || true
            # shellcheck disable=SC2016 # expanded by the inner bash on every poll
            wait_until 30 "jobs gone" bash -c '[[ -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" ]]' ||
                log "jobs still listed after 30s; stopping anyway"
        fi
    fi
    stop_pidfile slurmd "$STATE_DIR/slurmd.started"
    stop_pidfile slurmctld "$STATE_DIR/slurmctld.started"
    stop_pidfile munged "$STATE_DIR/munged.started"
    if [[ -f "$CONF" ]] && grep -qF "$MARKER" "$CONF"; then
        rm -f "$CONF"
        log "removed $CONF"
    fi
    if [[ -d "$STATE_DIR" ]]; then
        rm -rf "$STATE_DIR"
        log "removed $STATE_DIR"
    fi
    log "stopped"
}

cmd_status() {
    local ok=0 name f
    for name in munged slurmctld slurmd; do
        f="$STATE_DIR/$name.pid"
        [[ "$name" == munged ]] && f="$MUNGE_PID"
        if pid_alive "$f"; then
            echo "$name: running (pid $(tr -dc '0-9' <"$f"))"
        else
            echo "$name: not running"
            ok=1
        fi
    done
    if command -v sinfo >/dev/null 2>&1 && timeout 10 sinfo >/dev/null 2>&1; then
        timeout 10 sinfo
        node_idle || ok=1
    else
        echo "sinfo: no answer from slurmctld"
        ok=1
    fi
    return "$ok"
}

case "$CMD" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*) usage ;;
esac
