#!/usr/bin/env bash
# A Slurm cluster on this machine, for trying and testing hororing under srun, salloc and
# sbatch as cluster users run it (Debian or Ubuntu, as root).
#
#   bash scripts/slurm_local.sh up [--nodes N] [--cpus C] [--dir D]
#   bash scripts/slurm_local.sh down [--dir D]
#   bash scripts/slurm_local.sh env [--dir D]       # the lines to source: SLURM_CONF
#
# `up` installs Slurm and munge from the distribution if they are missing (slurm-wlm, munge,
# libpmix-dev), starts munged, slurmctld and N slurmd, and waits until every node is idle.
# Node n1 is this machine. With N > 1 every node nI runs in a network namespace of its own
# on a bridge (scripts/emulated_hosts.sh's hosts, namespaces hororing-sn1..snN, with hostnames n1..nN and
# /etc/hosts naming them), so MPI ranks on different nodes talk over a link, as on a cluster;
# then n1 is a namespace too. Each node declares C CPUs (default 4: more than this machine
# has, so a job can be as wide as a real one); one partition, `debug`, takes every node and
# lets jobs share CPUs. Everything lives in D (default /tmp/hororing-slurm): slurm.conf,
# state, logs (slurmctld.log, slurmd.nI.log), munge's key and socket.
#
# Exit codes: 3 not root, 4 Slurm could not be installed, 5 the cluster did not come up (the
# logs say why).
set -euo pipefail

command=${1:-}
shift || true
nodes=1
cpus=4
dir=/tmp/hororing-slurm
while [ $# -gt 0 ]; do
    case $1 in
        --nodes) nodes=$2; shift 2 ;;
        --cpus) cpus=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        *) echo "slurm_local.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd)
hosts_dir=$dir/hosts
# the nodes' network namespaces: scripts/emulated_hosts.sh's hosts under names and addresses of
# their own (hororing-snI on bridge snbr0, 10.214.0.0/24), apart from the emulated hosts
subnet=10.214.0
hosts() { EMULATED_HOSTS_TAG=sn EMULATED_HOSTS_SUBNET=$subnet bash "$here/emulated_hosts.sh" "$@"; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
            && command -v munged >/dev/null && command -v srun >/dev/null \
            && ls /usr/lib/*/libpmix.so >/dev/null 2>&1; then
        return 0
    fi
    command -v apt-get >/dev/null || { echo "slurm_local.sh: needs apt-get (Debian/Ubuntu)" >&2; exit 4; }
    echo "slurm_local.sh: installing slurm-wlm, munge and libpmix-dev"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        slurm-wlm slurmctld slurmd slurm-client munge libpmix-dev >/dev/null; } \
        || { echo "slurm_local.sh: apt-get could not install Slurm" >&2; exit 4; }
}

down() {
    local pid
    for name in slurmctld munged; do
        [ -f "$dir/$name.pid" ] && kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
    done
    for pid in "$dir"/slurmd.*.pid; do
        [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
    done
    # the daemons take a second or two to exit; jobs' processes go with the hosts below
    for _ in $(seq 1 50); do
        pgrep -f "$dir/slurm.conf|munged.*$dir" >/dev/null 2>&1 || break
        sleep 0.1
    done
    pkill -9 -f "slurmd -f $dir/slurm.conf" 2>/dev/null || true
    pkill -9 -f "slurmctld -f $dir/slurm.conf" 2>/dev/null || true
    pkill -9 -f "munged.*$dir" 2>/dev/null || true
    if [ -d "$hosts_dir" ]; then
        hosts down --dir "$hosts_dir" >/dev/null 2>&1 || true
    fi
    rm -rf "$dir"
}

node_address() {  # node_address I
    if [ "$nodes" -gt 1 ]; then echo "$subnet.$((10 + $1))"; else echo 127.0.0.1; fi
}

write_config() {
    local controller=127.0.0.1 i
    [ "$nodes" -gt 1 ] && controller=$subnet.1
    cat > "$dir/slurm.conf" <<EOF
ClusterName=hororing
SlurmctldHost=$(hostname)($controller)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPort=16817
SlurmdPort=16818
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=30
EOF
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=n$i NodeAddr=$(node_address "$i") CPUs=$cpus State=UNKNOWN" >> "$dir/slurm.conf"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" \
        >> "$dir/slurm.conf"
    # the pmix plugin wants a temporary directory per node
    echo "PMIxCliTmpDirBase=$dir/pmix" > "$dir/mpi.conf"
}

start_munge() {
    mkdir -p "$dir/munge"
    chmod 755 "$dir" "$dir/munge"  # munged refuses a socket directory others cannot enter
    chown munge:munge "$dir/munge"
    runuser -u munge -- mungekey --create --keyfile="$dir/munge/munge.key" --force
    runuser -u munge -- munged --socket="$dir/munge/munge.socket.2" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
        --seed-file="$dir/munge/munged.seed" --key-file="$dir/munge/munge.key"
    cp "$dir/munge/munged.pid" "$dir/munged.pid"
}

start_slurmd() {  # start_slurmd I
    local name=n$1
    mkdir -p "$dir/spool/$name" "$dir/pmix/$name"
    if [ "$nodes" -gt 1 ]; then
        # its own network, hostname and /etc/hosts; the pmix directory bind-mounted per node
        # /sys is mounted again for this network (UCX finds its interfaces there; the root
        # network's devices are unreachable from here), keeping the cgroup mount slurmd needs
        mkdir -p "$dir/cgroup/$name"
        nsenter --net="/run/netns/hororing-sn$1" unshare --uts --mount sh -c "
            set -e
            hostname $name
            mount --bind $dir/hosts.txt /etc/hosts
            mount --bind $dir/pmix/$name $dir/pmix
            mount --rbind /sys/fs/cgroup $dir/cgroup/$name
            mount -t sysfs sysfs /sys
            mount --move $dir/cgroup/$name /sys/fs/cgroup
            exec slurmd -f $dir/slurm.conf -N $name"
    else
        slurmd -f "$dir/slurm.conf" -N "$name"
    fi
}

case $command in
    up)
        if [ "$(id -u)" != 0 ]; then
            echo "slurm_local.sh: starting Slurm's daemons needs root" >&2
            exit 3
        fi
        install
        down
        mkdir -p "$dir/state" "$dir/pmix"
        if [ "$nodes" -gt 1 ]; then
            hosts up "$nodes" --rate 10gbit --dir "$hosts_dir" >/dev/null
            { echo "127.0.0.1 localhost"; echo "$subnet.1 $(hostname)";
              for i in $(seq 1 "$nodes"); do echo "$(node_address "$i") n$i"; done; } > "$dir/hosts.txt"
        fi
        write_config
        export SLURM_CONF=$dir/slurm.conf
        start_munge
        slurmctld -f "$dir/slurm.conf"
        for i in $(seq 1 "$nodes"); do start_slurmd "$i"; done
        for _ in $(seq 1 100); do
            idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)
            [ "$idle" -ge "$nodes" ] && break
            sleep 0.2
        done
        if [ "${idle:-0}" -lt "$nodes" ]; then
            echo "slurm_local.sh: only ${idle:-0} of $nodes node(s) idle after 20 s; see $dir/*.log" >&2
            sinfo >&2 || true
            exit 5
        fi
        echo "export SLURM_CONF=$dir/slurm.conf" > "$dir/env"
        echo "slurm_local.sh: $nodes node(s) of $cpus CPUs up; source $dir/env (SLURM_CONF=$dir/slurm.conf)"
        ;;
    down) down ;;
    env) cat "$dir/env" ;;
    *)
        echo "usage: slurm_local.sh up [--nodes N] [--cpus C] [--dir D] | down [--dir D] | env [--dir D]" >&2
        exit 2
        ;;
esac
