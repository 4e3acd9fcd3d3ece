#!/usr/bin/env bash
# Install hororing and its test dependencies into .venv, then run every test:
# unit tests and whole-job launches in one process, then the multi-rank suite under
# mpiexec at 1, 2, 3 and 4 ranks. Every mpiexec has a hard timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# torch is pinned to the CPU build available here; the package itself accepts any torch >= 2.0
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[mpi,test,torch]"
export PATH="$PWD/.venv/bin:$PATH"

python -m pytest -q -p no:cacheprovider tests/unit tests/launch

for ranks in 1 2 3 4; do
    echo "== tests/mpi on $ranks rank(s) =="
    timeout 900 mpiexec -n "$ranks" python -m pytest --with-mpi -q -p no:cacheprovider \
        --timeout=300 --timeout-method=thread tests/mpi
done
