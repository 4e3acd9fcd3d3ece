#!/usr/bin/env bash
# Install hororing (with a pip MPI and torch) into .venv and run the main job: data-parallel
# training on the digits data set shipped with scikit-learn, 4 ranks under mpiexec.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[mpi,torch,test]"
export PATH="$PWD/.venv/bin:$PATH"

ranks=${RANKS:-4}
timeout 600 mpiexec -n "$ranks" python examples/train.py "$@"
