#!/usr/bin/env bash
# The world of a Kubeflow MPI Operator job (MPIJob v2beta1), on this machine: a launcher pod
# that is not a worker and N worker pods, each an emulated host (scripts/emulated_hosts.sh: a
# network namespace with a shaped link) under the pod's hostname; every worker runs sshd, as
# the Operator's worker pods do (sshd -De), and the launcher reaches them over ssh by their
# fully qualified service names, listed in the Operator's host file. Needs root and Debian's
# openssh-server (installed with apt-get when missing).
#
#   bash scripts/mpi_operator_local.sh up --workers N [--slots S] [--rate R] [--dir D]
#        [--path P]
#   bash scripts/mpi_operator_local.sh launcher [--dir D] [--mpi openmpi|mpich] -- CMD...
#   bash scripts/mpi_operator_local.sh down [--dir D]
#
# `up` writes, in D (default /tmp/hororing-mpijob):
#   hostfile          the Operator's host file for Open MPI: "NAME slots=S" per worker
#   hostfile.mpich    the same for MPICH and Intel MPI: "NAME:S"
#   discover_hosts.sh the Operator's elastic discovery (/etc/mpi/discover_hosts.sh): prints
#                     "NAME:S" per worker listed in D/live-hosts (all of them at first); edit
#                     live-hosts to drop or add a worker
#   ssh/              the key pair and authorized_keys of the job (the Operator's Secret), and
#                     the launcher's ssh client config (no host key prompts, as the images set)
# `launcher` runs CMD in the launcher pod: its hostname, its namespace, ssh on PATH with the
# job's config, and the Operator's variables for the MPI named by --mpi (default openmpi):
# K_MPI_JOB_ROLE=launcher and OMPI_MCA_orte_default_hostfile=D/hostfile, or
# HYDRA_HOST_FILE=D/hostfile.mpich. The workers' sshd gives remote commands PATH=P (--path,
# default this machine's PATH at `up`): the image's PATH, where MPI's daemons are found.
# Names: launcher "train-launcher", workers "train-worker-I.train.default.svc" (I from 0).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
command=${1:-}
shift || true
workers=0
slots=1
rate=10gbit
dir=/tmp/hororing-mpijob
path=$PATH
mpi=openmpi
while [ $# -gt 0 ]; do
    case $1 in
        --workers) workers=$2; shift 2 ;;
        --slots) slots=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --path) path=$2; shift 2 ;;
        --mpi) mpi=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "mpi_operator_local.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

job=train
domain=$job.default.svc
subnet=10.215.0
hosts() { EMULATED_HOSTS_TAG=kf EMULATED_HOSTS_SUBNET=$subnet bash "$here/emulated_hosts.sh" "$@"; }
worker_name() { echo "$job-worker-$1"; }  # worker I is emulated host kf(I+2); kf1 the launcher

down() {
    hosts down --dir "$dir/hosts" >/dev/null 2>&1 || true
    local ns
    for ns in /etc/netns/hororing-kf*; do
        [ -e "$ns" ] && rm -rf "$ns"
    done
    rm -rf "$dir"
}

case $command in
    up)
        [ "$workers" -ge 1 ] || { echo "mpi_operator_local.sh: up needs --workers N" >&2; exit 2; }
        if ! command -v sshd >/dev/null && [ ! -x /usr/sbin/sshd ]; then
            command -v apt-get >/dev/null || { echo "mpi_operator_local.sh: needs sshd (openssh-server)" >&2; exit 4; }
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                --no-install-recommends openssh-server openssh-client; } >/dev/null 2>&1 \
                || { echo "mpi_operator_local.sh: apt-get could not install openssh-server" >&2; exit 4; }
        fi
        down
        mkdir -p "$dir/ssh" "$dir/bin" /run/sshd
        hosts up $((workers + 1)) --slots "$slots" --rate "$rate" --dir "$dir/hosts" >/dev/null
        ssh-keygen -q -t ed25519 -N "" -C "$job" -f "$dir/ssh/id_ed25519"
        ssh-keygen -q -t ed25519 -N "" -C "$job-host" -f "$dir/ssh/host_ed25519"
        cp "$dir/ssh/id_ed25519.pub" "$dir/ssh/authorized_keys"
        cat > "$dir/ssh/config" <<EOF
Host *
    IdentityFile $dir/ssh/id_ed25519
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    ConnectionAttempts 10
EOF
        # ssh as the launcher image has it: the job's key and config (Hydra and Open MPI both
        # start their daemons with the ssh they find on PATH)
        printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$dir/ssh/config" > "$dir/bin/ssh"
        chmod +x "$dir/bin/ssh"
        # the cluster's DNS: every pod's names, in each namespace's /etc/hosts
        table="127.0.0.1 localhost"$'\n'"$subnet.11 $job-launcher.$domain $job-launcher"$'\n'
        : > "$dir/hostfile"
        : > "$dir/hostfile.mpich"
        : > "$dir/live-hosts"
        for i in $(seq 0 $((workers - 1))); do
            name=$(worker_name "$i")
            table+="$subnet.$((12 + i)) $name.$domain $name"$'\n'
            echo "$name.$domain slots=$slots" >> "$dir/hostfile"
            echo "$name.$domain:$slots" >> "$dir/hostfile.mpich"
            echo "$name.$domain:$slots" >> "$dir/live-hosts"
        done
        for i in $(seq 1 $((workers + 1))); do
            mkdir -p "/etc/netns/hororing-kf$i"
            printf '%s' "$table" > "/etc/netns/hororing-kf$i/hosts"
        done
        printf '#!/bin/sh\n# the MPI Operator'"'"'s /etc/mpi/discover_hosts.sh: the workers running now\ncat %s\n' \
            "$dir/live-hosts" > "$dir/discover_hosts.sh"
        chmod +x "$dir/discover_hosts.sh"
        for i in $(seq 0 $((workers - 1))); do
            name=$(worker_name "$i")
            cat > "$dir/ssh/sshd_config.$i" <<EOF
ListenAddress $subnet.$((12 + i))
HostKey $dir/ssh/host_ed25519
AuthorizedKeysFile $dir/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
SetEnv PATH=$path
MaxStartups 100:30:200
EOF
            # sshd -De in the worker pod, under the pod's hostname; ended by `down` (every
            # process inside the emulated hosts)
            setsid ip netns exec "hororing-kf$((i + 2))" unshare --uts sh -c \
                "hostname $name; exec /usr/sbin/sshd -D -e -f $dir/ssh/sshd_config.$i" \
                > "$dir/sshd.$i.log" 2>&1 < /dev/null &
        done
        # every worker's sshd answers before `up` returns
        for i in $(seq 0 $((workers - 1))); do
            name=$(worker_name "$i").$domain
            for _ in $(seq 1 100); do
                if ip netns exec hororing-kf1 "$dir/bin/ssh" -o ConnectTimeout=2 "$name" true \
                        2>/dev/null; then
                    continue 2
                fi
                sleep 0.1
            done
            echo "mpi_operator_local.sh: the sshd of $name does not answer:" >&2
            cat "$dir/sshd.$i.log" >&2
            down
            exit 5
        done
        echo "mpi_operator_local.sh: MPIJob '$job': launcher and $workers workers x $slots slots at $rate; $dir/hostfile"
        ;;
    launcher)
        [ $# -gt 0 ] || { echo "mpi_operator_local.sh: launcher needs a command after --" >&2; exit 2; }
        case $mpi in
            openmpi) variables=(OMPI_MCA_orte_default_hostfile="$dir/hostfile") ;;
            mpich) variables=(HYDRA_HOST_FILE="$dir/hostfile.mpich") ;;
            *) echo "mpi_operator_local.sh: --mpi is openmpi or mpich" >&2; exit 2 ;;
        esac
        exec ip netns exec hororing-kf1 unshare --uts env K_MPI_JOB_ROLE=launcher \
            "${variables[@]}" PATH="$dir/bin:$PATH" sh -c 'hostname "$0"; exec "$@"' \
            "$job-launcher" "$@"
        ;;
    down) down ;;
    *)
        echo "usage: mpi_operator_local.sh up --workers N [--slots S] [--rate R] [--dir D] [--path P] | launcher [--dir D] [--mpi openmpi|mpich] -- CMD... | down [--dir D]" >&2
        exit 2
        ;;
esac
