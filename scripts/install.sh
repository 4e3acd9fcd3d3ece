#!/usr/bin/env bash
# Create .venv (if missing) and install hororing into it with the pip MPI, torch, TensorFlow
# and test extras. torch is pinned to the CPU build available here; the package accepts torch >= 2.1.
# Sourced by examples/run.sh and tests/run.sh from the repository root; puts .venv on PATH.
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[mpi,test,torch,tensorflow]"
# tf-keras (TF_USE_LEGACY_KERAS=1) for its test; it names the full "tensorflow" package as
# a dependency, which would install a second copy of the tensorflow-cpu files just installed
.venv/bin/pip install -q --disable-pip-version-check --no-deps "tf-keras==2.21.*"
# the opt-in 'import horovod' alias (HORORING_AS_HOROVOD=1), which a wheel puts in
# site-packages itself and an editable install does not
cp hororing/horovod-alias.pth "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hororing-horovod-alias.pth"
export PATH="$PWD/.venv/bin:$PATH"
