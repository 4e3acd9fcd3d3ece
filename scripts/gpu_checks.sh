#!/usr/bin/env bash
# What needs a GPU, in one go, on a machine where hororing, cupy, numba and a CUDA build of
# torch are installed and mpiexec is on PATH:
#   the GPU tests (tests/gpu), the device and torch suites at 2 ranks sharing GPU 0,
#   examples/train.py --device cuda at 2 ranks, the GPU benchmark (scripts/bench_gpu.py)
#   and training step time on CUDA beside DistributedDataParallel (scripts/bench_training.py).
# Usage: bash scripts/gpu_checks.sh [OUTDIR]   (default results/gpu). Everything goes to
# OUTDIR/gpu_checks.log; the benchmarks also write OUTDIR/gpu.json and OUTDIR/training_cuda.json.
# Each step has a hard timeout; a failed step is reported and the rest still run.
set -u
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
mkdir -p "$out"
log="$out/gpu_checks.log"
: > "$log"
failed=()

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$log"
    local started=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - started)) s" | tee -a "$log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

step versions 60 python -c "
import sys, numpy, numba, cupy, torch, mpi4py
from mpi4py import MPI
print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__,
      'cupy', cupy.__version__, 'torch', torch.__version__, 'mpi4py', mpi4py.__version__)
print(MPI.Get_library_version().splitlines()[0])
print(torch.cuda.get_device_name(0), cupy.cuda.runtime.runtimeGetVersion())"
step gpu_tests 420 python -m pytest -q -p no:cacheprovider -rs tests/gpu
step device_suites_2_ranks 420 mpiexec -n 2 python -m pytest --with-mpi -q -p no:cacheprovider \
    --timeout=300 --timeout-method=thread tests/mpi/test_device.py tests/mpi/test_torch.py
step train_cuda_2_ranks 300 mpiexec -n 2 python examples/train.py --device cuda \
    --checkpoint /tmp/hororing-gpu-checkpoint.pt
step bench_gpu 480 python scripts/bench_gpu.py --json "$out/gpu.json"
step bench_training_cuda 480 python scripts/bench_training.py --device cuda --sizes 1 2 \
    --json "$out/training_cuda.json"
if [ ${#failed[@]} -ne 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "all GPU checks passed" | tee -a "$log"
