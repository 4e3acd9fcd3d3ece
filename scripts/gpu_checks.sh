#!/usr/bin/env bash
# What needs a GPU, in one go, on a machine where hororing, cupy, numba and a CUDA build of
# torch are installed and mpiexec is on PATH (two ranks share GPU 0 throughout):
#   smoke           one 2-rank job of cupy collectives over the device-direct ring
#   numpy_example   examples/train_numpy.py --device gpu at 2 ranks
#   bench_gpu       scripts/bench_gpu.py: kernels on one GPU, then the device allreduce beside
#                   the host ring at 1, 8 and 64 MiB, device-direct and staged
#   bench_training  scripts/bench_training.py --device cuda: step time beside DDP at 2 ranks
#   bench_compression  scripts/bench_compression.py --device cuda at 2 ranks, the large model:
#                   hororing's hooks beside DDP's over gloo, the direct and then the staged ring
#   gpu_tests       tests/gpu (kernels on the GPU, 2-rank cupy and torch jobs over each
#                   transport, both examples on the GPU)
#   kernels         tests/unit/test_cuda_kernels.py with the kernels on the GPU
#   device_direct   tests/mpi/test_device.py, test_torch*.py at 2 ranks on the GPU, direct ring
#                   for every bucket size
#   device_staged   the same with HORORING_DEVICE_RING=staged
#   train           examples/train.py --device cuda at 2 ranks
# Usage: bash scripts/gpu_checks.sh [OUTDIR [STEP ...]]   (default results/gpu, every step;
# GPU_TESTS_ARGS: more pytest arguments for gpu_tests, e.g. "-k hooks").
# Everything goes to OUTDIR/gpu_checks.log; the benchmarks also write OUTDIR/gpu.json and
# OUTDIR/training_cuda.json. Each step has a hard timeout; a failed step is reported and the
# rest still run.
set -u
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
shift || true
steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
    steps=(versions smoke numpy_example bench_gpu bench_training bench_compression gpu_tests kernels
           device_direct device_staged train)
fi
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

mpi_pytest=(python -m pytest --with-mpi -q -p no:cacheprovider --timeout=200
            --timeout-method=thread tests/mpi/test_device.py tests/mpi/test_torch.py
            tests/mpi/test_torch_optimizer.py tests/mpi/test_torch_buckets.py)

for name in "${steps[@]}"; do
    case $name in
    versions)
        step versions 60 python -c "
import sys, numpy, numba, cupy, torch, mpi4py
from mpi4py import MPI
print(sys.version.split()[0], 'numpy', numpy.__version__, 'numba', numba.__version__,
      'cupy', cupy.__version__, 'torch', torch.__version__, 'mpi4py', mpi4py.__version__)
print(MPI.Get_library_version().splitlines()[0])
print(torch.cuda.get_device_name(0), 'CUDA runtime', cupy.cuda.runtime.runtimeGetVersion())" ;;
    smoke)
        HORORING_DEVICE_RING=direct step smoke 90 mpiexec -n 2 python \
            tests/gpu/jobs/cupy_collectives.py direct ;;
    numpy_example)
        step numpy_example 120 mpiexec -n 2 python examples/train_numpy.py --device gpu ;;
    bench_gpu)
        step bench_gpu 240 python scripts/bench_gpu.py --sizes $((64 << 20)),$((256 << 20)) \
            --json "$out/gpu.json" ;;
    bench_training)
        step bench_training 240 python scripts/bench_training.py --device cuda --sizes 2 \
            --rounds 9 --json "$out/training_cuda.json" ;;
    bench_compression)
        for ring in direct staged; do
            HORORING_DEVICE_RING=$ring step "bench_compression_$ring" 240 mpiexec -n 2 python \
                scripts/bench_compression.py --device cuda --models large --rounds 5 --steps 3 \
                --variants "hororing none" "hororing fp16" "hororing bf16" "hororing powersgd4" \
                "ddp allreduce" "ddp fp16" "ddp bf16" "ddp powersgd4" alone --json "$out/compression_cuda_$ring.json"
        done ;;
    gpu_tests)
        step gpu_tests 300 python -m pytest -q -p no:cacheprovider -rs tests/gpu ${GPU_TESTS_ARGS:-} ;;
    kernels)
        NUMBA_ENABLE_CUDASIM=0 step kernels 120 python -m pytest -q -p no:cacheprovider \
            tests/unit/test_cuda_kernels.py ;;
    device_direct)
        NUMBA_ENABLE_CUDASIM=0 HORORING_DEVICE_RING=direct HORORING_DEVICE_DIRECT_MIN_BYTES=0 \
            step device_direct 240 mpiexec -n 2 "${mpi_pytest[@]}" ;;
    device_staged)
        NUMBA_ENABLE_CUDASIM=0 HORORING_DEVICE_RING=staged step device_staged 240 \
            mpiexec -n 2 "${mpi_pytest[@]}" ;;
    train)
        step train 180 mpiexec -n 2 python examples/train.py --device cuda \
            --checkpoint /tmp/hororing-gpu-checkpoint.pt ;;
    *)
        echo "unknown step $name" | tee -a "$log"
        failed+=("$name") ;;
    esac
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "failed: ${failed[*]}" | tee -a "$log"
    exit 1
fi
echo "all GPU checks passed" | tee -a "$log"
