#!/usr/bin/env bash
# Install hororing and its test dependencies into .venv, then run every test:
# unit tests and whole-job launches in one process, then the multi-rank suite under
# mpiexec at 1, 2, 3 and 4 ranks. Every mpiexec has a hard timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/install.sh

python -m pytest -q -p no:cacheprovider tests/unit tests/launch

for ranks in 1 2 3 4; do
    echo "== tests/mpi on $ranks rank(s) =="
    timeout 900 mpiexec -n "$ranks" python -m pytest --with-mpi -q -p no:cacheprovider \
        --timeout=300 --timeout-method=thread tests/mpi
done
