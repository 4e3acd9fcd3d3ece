#!/usr/bin/env bash
# Build hororing's wheel and install it, as a user would, into a fresh virtual environment
# (Python's own bundled pip and setuptools, no editable install), then import every
# subpackage from outside the checkout and run a 2-rank allreduce with the installed copy; then
# a script written for Horovod ('import horovod.torch as hvd') under the wheel's opt-in alias,
# by mpiexec with HORORING_AS_HOROVOD=1 and by hororun --as-horovod. The ring's compiled
# steps from the installed copy (made ahead into numba's cache beside it, then loaded), and
# the Python steps once numba is uninstalled.
# Usage, from the repository root: bash scripts/check_wheel.sh
set -euo pipefail
root=$(pwd)
python=${PYTHON:-python3}
work=$(mktemp -d -t hororing-wheel.XXXX)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" build
# built from a copy of the checkout's files (those git tracks, and new ones it does not
# ignore): nothing is written into the checkout, which other jobs may be installing from, and
# nothing left in its build/ from an older build can slip into the wheel
tree=$root
if git -C "$root" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    tree=$work/source
    mkdir "$tree"
    (cd "$root" && git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf -) | tar -C "$tree" -xf -
fi
"$work/venv/bin/python" -m build --wheel --outdir "$work/dist" "$tree" > "$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/hororing-*.whl)
echo "built $(basename "$wheel")"
"${pip[@]}" torch==2.13.0
"${pip[@]}" "$wheel[mpi,torch,tensorflow]"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import importlib, pkgutil, sys
import hororing
assert hororing.__file__.startswith(sys.prefix), hororing.__file__
names = ["hororing"] + [m.name for m in pkgutil.walk_packages(hororing.__path__, "hororing.")]
optional = {"cupy"}  # the cuda extra
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name.split(".")[0] not in optional:
            raise
        print(f"skipped {name}: needs {error.name} (the cuda extra)")
for needed in ("hororing.kernels", "hororing.gpu", "hororing.torch", "hororing.engine",
               "hororing.tensorflow", "hororing.tensorflow.keras", "hororing.keras"):
    assert needed in names, needed
print(f"imported {len(names)} modules from {hororing.__path__[0]}")
PY
timeout 120 "$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" -c '
import numpy as np
import torch
import hororing.torch as hvd
hvd.init()
rank = hvd.rank()
tensor = hvd.allreduce(torch.arange(7.0) * (rank + 1), op=hvd.Sum)
assert torch.equal(tensor, torch.arange(7.0) * 3), tensor
import hororing
array = hororing.allreduce(np.arange(5, dtype=np.int64) + rank, op=hororing.Sum)
assert array.tolist() == [2 * i + 1 for i in range(5)], array
import tensorflow as tf
import hororing.tensorflow as hvd_tf
gathered = hvd_tf.allgather(tf.fill([rank + 1], rank))
assert gathered.numpy().tolist() == [0, 1, 1], gathered
print(f"rank {rank}: 2-rank allreduce from the installed wheel OK")
'
# Horovod's import names, from the wheel's .pth: absent without the variable
if "$work/venv/bin/python" -c "import horovod" 2>/dev/null; then
    echo "import horovod succeeded without HORORING_AS_HOROVOD" >&2
    exit 1
fi
cat > "$work/horovod_style.py" <<'PY'
import torch
import horovod.torch as hvd
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = model.weight.detach().clone()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
model(torch.full((3, 4), float(hvd.rank() + 1))).sum().backward()
optimizer.step()
# the gradient of the summed output by each weight is the batch's sum, 3 (rank + 1): averaged
# over ranks 0 and 1, 4.5
assert torch.allclose(model.weight, start - 0.1 * 4.5), (model.weight, start)
print(f"rank {hvd.rank()}: horovod.torch is {hvd.__name__}: one averaged step OK")
PY
HORORING_AS_HOROVOD=1 timeout 120 "$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" \
    "$work/horovod_style.py"
timeout 120 "$work/venv/bin/hororun" --as-horovod -np 2 "$work/venv/bin/python" \
    "$work/horovod_style.py"
cat > "$work/compiled_ring.py" <<'PY'
import sys
import numpy as np
import hororing as hvd
from hororing.algorithms import compiled
hvd.init()
from hororing.algorithms.cost import SHARED_LARGEST_BYTES
count = SHARED_LARGEST_BYTES // 4 + 1001  # past the shared allreduce's sizes: the ring's
values = np.arange(count, dtype=np.float32) * (hvd.rank() + 1)
result = hvd.allreduce(values, op=hvd.Sum, name="wheel.ring")
assert np.array_equal(result, np.arange(count, dtype=np.float32) * 3), result[:4]
expected = sys.argv[1]
assert compiled.status().startswith(expected), (compiled.status(), expected)
print(f"rank {hvd.rank()}: a ring from the installed wheel, steps: {compiled.status()}")
PY
# the float32 steps into the installed package's cache ahead, then the ring loads them
timeout 300 "$work/venv/bin/python" -m hororing.algorithms.compiled --dtypes float32 \
    | tee "$work/ahead.log"
grep -q "loaded from the cache at $work/venv/.*/site-packages/hororing/" "$work/ahead.log"
HORORING_COMPILED_STEPS=wait timeout 300 "$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" \
    "$work/compiled_ring.py" compiled
"$work/venv/bin/pip" uninstall -q -y numba
if "$work/venv/bin/python" -m hororing.algorithms.compiled 2> "$work/ahead.err"; then
    echo "compiling ahead without numba should fail" >&2
    exit 1
fi
grep -q "numba is not installed" "$work/ahead.err"
HORORING_COMPILED_STEPS=wait timeout 120 "$work/venv/bin/mpiexec" -n 2 "$work/venv/bin/python" \
    "$work/compiled_ring.py" "python (ModuleNotFoundError"
