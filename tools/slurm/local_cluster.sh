#!/bin/bash
# A private two-node SLURM cluster on this one machine: slurmctld, two slurmd daemons
# standing for nodes n1 and n2 (both at 127.0.0.1, each on its own port) and a munged of
# its own. For the tests (tests/test_slurm.py) and for trying examples/slurm/*.sbatch
# without a cluster.
#
#   tools/slurm/local_cluster.sh up|down|status|env [DIR]
#
#   up      install slurm-wlm and munge with apt when missing, write DIR/slurm.conf, start
#           the daemons (those not already running) and wait until both nodes are idle
#   down    cancel this cluster's jobs, stop the daemons it started (by their pid files)
#           and remove DIR (set LOCAL_SLURM_KEEP=1 to keep its logs)
#   status  which daemons run, and sinfo
#   env     the line a client needs: eval "$(tools/slurm/local_cluster.sh env)"
#
# DIR (default $LOCAL_SLURM_DIR, else ${TMPDIR:-/tmp}/megatron-2bw-slurm) holds everything:
# slurm.conf, the munge key and socket, state, spool, logs and pid files. Nothing under
# /etc is read or written (apt aside): clients get the file through SLURM_CONF, the
# daemons through -f, and slurm.conf names the private munge socket (AuthInfo=socket=).
# Ports: three free ones from $LOCAL_SLURM_PORT (default 16817) up, below Linux's
# ephemeral range, so the free ports tests take from the kernel never collide with them.
# Needs root (slurmd starts job steps as the submitting user).
set -euo pipefail

CMD=${1:-}
DIR=${2:-${LOCAL_SLURM_DIR:-${TMPDIR:-/tmp}/megatron-2bw-slurm}}
CONF=$DIR/slurm.conf
MARK=$DIR/.local-cluster   # what `down` may remove
NODES=(n1 n2)
export SLURM_CONF=$CONF
export PATH=$PATH:/usr/sbin   # the daemons, for a root shell whose PATH lacks it

die() { echo "local_cluster.sh: error: $*" >&2; exit 1; }

install_packages() {  # apt only when a program is missing; the packages' services stay unused
    local p
    for p in slurmctld slurmd munged munge sinfo sbatch scontrol; do
        command -v "$p" >/dev/null 2>&1 && continue
        echo "local_cluster.sh: installing slurm-wlm and munge (no $p)" >&2
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
              slurm-wlm munge; } >/dev/null || die "apt-get could not install slurm-wlm and munge"
        return
    done
}

port_free() {  # nothing listens on 127.0.0.1:$1
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_ports() {  # three free ports from the base up: slurmctld, slurmd n1, slurmd n2
    local port=${LOCAL_SLURM_PORT:-16817} found=()
    while [ ${#found[@]} -lt 3 ]; do
        [ "$port" -lt 32768 ] || die "no free ports between ${LOCAL_SLURM_PORT:-16817} and 32767"
        if port_free "$port"; then found+=("$port"); fi
        port=$((port + 1))
    done
    echo "${found[@]}"
}

alive() {  # the pid in file $1 runs program $2 (a reused pid of another program is not ours)
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1   # a daemon removes its pid file as it ends
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

searchable_by_all() {  # every folder from / down to $1 lets others through (o+x)
    local d=$1
    while [ "$d" != / ] && [ -n "$d" ]; do
        [ "$(( 0$(stat -c %a "$d") & 1 ))" -eq 1 ] || return 1
        d=$(dirname "$d")
    done
}

socket_dir() {  # where munged's socket goes: munged wants every folder above it open to all
    local d
    if searchable_by_all "$DIR"; then
        d=$DIR/munge-socket
        mkdir -p "$d"
    else   # e.g. under pytest's private temp dirs: a folder of its own in /tmp
        d=$(mktemp -d "${TMPDIR:-/tmp}/local-slurm-munge.XXXXXX")
    fi
    chmod 755 "$d"
    echo "$d"
}

write_conf() {
    local ports host cpus
    read -r -a ports <<<"$(free_ports)"
    host=$(hostname -s)
    cpus=${LOCAL_SLURM_CPUS:-4}
    mkdir -p "$DIR"/{state,log,munge,spool/n1,spool/n2}
    chmod 700 "$DIR/munge"
    socket_dir >"$DIR/munge-socket-dir"
    : >"$DIR/plugstack.conf"
    cat >"$CONF" <<EOF
# written by tools/slurm/local_cluster.sh; two nodes on this one machine
ClusterName=local2bw
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${ports[0]}
AuthType=auth/munge
AuthInfo=socket=$(cat "$DIR/munge-socket-dir")/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig=$DIR/plugstack.conf
SlurmdParameters=config_overrides
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdSpoolDir=$DIR/spool/%n
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=10
MinJobAge=600
InactiveLimit=0
MailProg=/bin/true
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[1]} CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=${ports[2]} CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    touch "$MARK"
}

start_munged() {  # key, seed and pid file in DIR/munge (private), the socket apart
    local m=$DIR/munge sock
    sock=$(cat "$DIR/munge-socket-dir")/munge.socket
    alive "$m/munged.pid" munged && return
    if [ ! -s "$m/munge.key" ]; then
        (umask 077; dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none)
    fi
    munged --socket="$sock" --key-file="$m/munge.key" --pid-file="$m/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$m/munged.seed"
    munge --socket="$sock" -n | unmunge --socket="$sock" >/dev/null \
        || die "munged at $sock does not answer; see $DIR/log/munged.log"
}

start_slurm() {
    local node
    alive "$DIR/slurmctld.pid" slurmctld || slurmctld -f "$CONF"
    for node in "${NODES[@]}"; do
        alive "$DIR/slurmd-$node.pid" slurmd || slurmd -f "$CONF" -N "$node"
    done
}

wait_idle() {  # both nodes idle (or allocated/mixed: jobs already run there), 60 s at most
    local states i
    for i in $(seq 120); do
        states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ')
        if [ "$(echo "$states" | grep -Eo '(idle|allocated|mixed)' | wc -l)" -eq 2 ]; then
            return
        fi
        sleep 0.5
    done
    die "nodes not idle after 60 s (sinfo: ${states:-no answer}); logs in $DIR/log"
}

up() {
    [ "$(id -u)" -eq 0 ] || die "needs root (slurmd starts job steps as their user)"
    install_packages
    [ -s "$CONF" ] || write_conf
    start_munged
    start_slurm
    wait_idle
    echo "local SLURM cluster up: nodes ${NODES[*]}; $DIR; clients need: export SLURM_CONF=$CONF"
}

stop() {  # stop the daemon whose pid file is $1 (program $2): TERM, then KILL after 10 s
    local pid i
    alive "$1" "$2" || return 0
    pid=$(cat "$1" 2>/dev/null) || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 100); do
        alive "$1" "$2" || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

cancel_jobs() {  # this cluster's jobs end (their steps with them) while slurmd still runs
    local i
    alive "$DIR/slurmctld.pid" slurmctld || return 0
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    for i in $(seq 60); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && return
        sleep 0.5
    done
}

down() {
    local node
    [ -d "$DIR" ] || return 0
    cancel_jobs
    for node in "${NODES[@]}"; do
        stop "$DIR/slurmd-$node.pid" slurmd
    done
    stop "$DIR/slurmctld.pid" slurmctld
    stop "$DIR/munge/munged.pid" munged
    if [ -s "$DIR/munge-socket-dir" ]; then   # the socket's folder, when it is apart
        case "$(cat "$DIR/munge-socket-dir")" in
            "$DIR"/*) ;;
            */local-slurm-munge.*) rm -rf "$(cat "$DIR/munge-socket-dir")" ;;
        esac
    fi
    if [ -e "$MARK" ] && [ "${LOCAL_SLURM_KEEP:-0}" != 1 ]; then
        rm -rf "$DIR"
    fi
}

status() {
    local f
    for f in munge/munged.pid:munged slurmctld.pid:slurmctld slurmd-n1.pid:slurmd \
             slurmd-n2.pid:slurmd; do
        if alive "$DIR/${f%%:*}" "${f##*:}"; then
            echo "${f%%:*}: running (pid $(cat "$DIR/${f%%:*}"))"
        else
            echo "${f%%:*}: not running"
        fi
    done
    [ -s "$CONF" ] && sinfo -N 2>/dev/null || true
}

case "$CMD" in
    up) up ;;
    down) down ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 up|down|status|env [DIR] (DIR defaults to \$LOCAL_SLURM_DIR or ${TMPDIR:-/tmp}/megatron-2bw-slurm)" ;;
esac
