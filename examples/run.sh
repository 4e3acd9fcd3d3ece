#!/usr/bin/env bash
# Install hororing (with a pip MPI and torch) into .venv and run the main job: data-parallel
# training on the digits data set shipped with scikit-learn, 4 ranks under mpiexec.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/install.sh

ranks=${RANKS:-4}
timeout 600 mpiexec -n "$ranks" python examples/train.py "$@"
