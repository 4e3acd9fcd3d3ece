#!/usr/bin/env bash
# The GPU and scale checks on a machine whose image has Python, torch, cupy and numba but not
# this project's MPI: wheels for that machine's Python (mpich, mpi4py, numpy, pytest-mpi) are
# installed under a prefix of their own, mpi4py is pointed at that MPICH, and nothing runs
# until a one-rank MPI start has answered within 30 s. (Installed with pip --target, the
# mpich wheel loses its lib/ folder, and mpi4py then loads whatever libmpi the image has: a
# run set up that way hung in a check that imports mpi4py and starts MPI, instead of failing.)
# Usage: bash scripts/lent_machine.sh WHEELDIR OUTDIR [STEP ...]
#   steps: scale (scripts/scale_checks.sh, CPU only), gpu (scripts/gpu_checks.sh),
#          calls (scripts/call_cost_checks.sh: a call's cost against MPI's, CPU only),
#          staged (the staged ring's copy size against the host ring, 8 and 64 MiB),
#          hosts (bench_compression across HOSTS (default 4) emulated 1 Gbit/s hosts, CPU only, a core per
#          rank: needs root, ip and tc on PATH; an image without iproute2 can be given a
#          folder of them, with their libraries, as IPROUTE_DIR/bin: scripts/pack_iproute.sh);
#   default: staged scale gpu. Each step has a hard timeout; logs and results in OUTDIR.
#   HOSTS_BENCH_ARGS: more bench_compression arguments for hosts (--variants, --rounds);
#   HOSTS_ENVS: settings for one run each, ';' between runs ("HORORING_X=1;HORORING_X=2");
#   HOSTS_PROBE: a script and its arguments run across the same 4 hosts first;
#   command: LENT_COMMAND (a bash line) with this MPI and the checkout on the paths, its
#   output in OUTDIR/command.log;
#   STAGED_ROUNDS (default 2) rounds of the copy-size sweep per staged step, over the copy
#   sizes STAGED_COPIES (bytes, default "8388608 2097152 1048576 524288") and the allreduce
#   sizes STAGED_BYTES (default 8388608,67108864); GPU_STEPS names
#   gpu_checks.sh's steps (default all of them), SCALE_RANKS scale_checks.sh's rank counts; a step is skipped once LENT_SECONDS (if set)
#   have passed, so that what was measured comes back before the call's limit.
set -u
cd "$(dirname "$0")/.."
wheels=${1:?usage: lent_machine.sh WHEELDIR OUTDIR [STEP ...]}
out=${2:?usage: lent_machine.sh WHEELDIR OUTDIR [STEP ...]}
shift 2
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(staged scale gpu)
mkdir -p "$out"
# the checkout itself is imported (kernels/ installs as hororing.kernels: a link stands in)
if [ ! -e hororing/kernels ]; then
    ln -s ../kernels hororing/kernels
    trap 'rm -f hororing/kernels' EXIT
fi
log="$out/lent_machine.log"
: > "$log"
started=$SECONDS
say() { echo "== $* ($((SECONDS - started)) s)" | tee -a "$log"; }

python=$(command -v python3)
prefix=/tmp/hororing-prefix
timeout 120 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --ignore-installed --prefix "$prefix" "$wheels"/*.whl >> "$log" 2>&1 || { say "pip failed"; exit 1; }
site=$(echo "$prefix"/lib/python3*/site-packages)
# "python" is the image's interpreter itself (a link to a virtual environment's python
# starts the base interpreter, without the environment's packages)
mkdir -p "$prefix/shim"
printf '#!/bin/sh\nexec %s "$@"\n' "$python" > "$prefix/shim/python"
chmod +x "$prefix/shim/python"
export PYTHONPATH="$site:$PWD" PATH="$prefix/shim:$prefix/bin:$PATH" PYTHONUNBUFFERED=1
export MPI4PY_LIBMPI="$prefix/lib/libmpi.so.12"
say "$(nproc) cores; $(nvidia-smi -L 2>/dev/null | head -1)"
if ! timeout 30 python -c "from mpi4py import MPI; import numpy
print(MPI.Get_library_version().splitlines()[0], 'numpy', numpy.__version__)" >> "$log" 2>&1 \
        || ! grep -q MPICH "$log"; then
    say "mpi4py did not start MPICH as one rank within 30 s: stopping"
    exit 1
fi
timeout 60 mpiexec -n 2 python -c "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 2" \
    >> "$log" 2>&1 || { say "a 2-rank mpiexec job failed: stopping"; exit 1; }

for step in "${steps[@]}"; do
    if [ -n "${LENT_SECONDS:-}" ] && [ $((SECONDS - started)) -ge "$LENT_SECONDS" ]; then
        say "skipped $step: LENT_SECONDS=$LENT_SECONDS passed"
        continue
    fi
    case $step in
    staged)
        say "staged ring: copy size against the host ring"
        staged_runs=$((${staged_runs:-0} + 1))
        for round in $(seq "${STAGED_ROUNDS:-2}"); do
            for copy in ${STAGED_COPIES:-8388608 2097152 1048576 524288}; do
                HORORING_DEVICE_RING=staged HORORING_STAGED_COPY_BYTES=$copy timeout 90 \
                    mpiexec -n 2 python scripts/bench_gpu.py --ring-child \
                    --ring-bytes "${STAGED_BYTES:-8388608,67108864}" --rounds 7 --seconds 2 2>&1 \
                    | sed "s/^/copy=$copy round=$staged_runs.$round /" >> "$out/staged.jsonl"
            done
        done
        grep -c '"device_over_host"' "$out/staged.jsonl" | sed 's/^/rows: /' | tee -a "$log" ;;
    scale)
        say "scale checks"
        CUDA_VISIBLE_DEVICES= HORORING_SELECT_DEVICE=0 timeout 900 \
            bash scripts/scale_checks.sh "$out/scale" ${SCALE_RANKS:-} >> "$log" 2>&1 || say "scale: exit $?" ;;
    calls)
        say "call cost checks"
        timeout 900 bash scripts/call_cost_checks.sh "$out/calls" >> "$log" 2>&1 \
            || say "calls: exit $?" ;;
    gpu)
        say "gpu checks"
        timeout 900 bash scripts/gpu_checks.sh "$out/gpu" ${GPU_STEPS:-} >> "$log" 2>&1 || say "gpu: exit $?" ;;
    hosts)
        hosts=${HOSTS:-4}
        say "bench_compression across $hosts emulated hosts"
        [ -n "${IPROUTE_DIR:-}" ] && export PATH="$IPROUTE_DIR/bin:$PATH"
        if ! bash scripts/emulated_hosts.sh up "$hosts" --rate 1gbit --dir /tmp/hororing-lent-hosts \
                >> "$log" 2>&1; then
            say "no emulated hosts here (root, ip and tc are needed)"
            continue
        fi
        hosts_mpiexec() {
            # CPU tensors only: with a GPU visible, DDP's PowerSGD hook asks for CUDA ones
            CUDA_VISIBLE_DEVICES= timeout "$1" mpiexec -f /tmp/hororing-lent-hosts/hostfile \
                $(cat /tmp/hororing-lent-hosts/mpi-args) -genvall -n "$hosts" "${@:2}"
        }
        if [ -n "${HOSTS_PROBE:-}" ]; then
            say "hosts probe: $HOSTS_PROBE"
            hosts_mpiexec 120 python $HOSTS_PROBE >> "$out/hosts_probe.log" 2>&1 \
                || say "hosts probe: exit $?"
        fi
        # one run per entry of HOSTS_ENVS ("A=1 B=2;C=3": the first run with A and B set,
        # the second with C), each with its own JSON; one plain run without it
        IFS=';' read -r -a host_envs <<< "${HOSTS_ENVS:-}"
        [ ${#host_envs[@]} -gt 0 ] || host_envs=("")
        for index in "${!host_envs[@]}"; do
            say "bench_compression run $index: ${host_envs[$index]:-defaults}"
            env hosts="$hosts" ${host_envs[$index]} bash -c "$(declare -f hosts_mpiexec); hosts_mpiexec 600 \
                python scripts/bench_compression.py --models large ${HOSTS_BENCH_ARGS:-} \
                --json '$out/compression_${hosts}hosts_$index.json'" >> "$log" 2>&1 || say "hosts: exit $?"
        done
        bash scripts/emulated_hosts.sh down --dir /tmp/hororing-lent-hosts >> "$log" 2>&1 ;;
    command)
        say "command: ${LENT_COMMAND:-}"
        timeout 600 bash -c "${LENT_COMMAND:?the command step runs LENT_COMMAND}" \
            >> "$out/command.log" 2>&1 || say "command: exit $?" ;;
    *)
        say "unknown step $step" ;;
    esac
done
say "done"
