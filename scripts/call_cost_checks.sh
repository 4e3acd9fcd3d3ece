#!/usr/bin/env bash
# A blocking call's cost against MPI_Allreduce, and the default algorithm against the forced
# ring, on a machine with a core per rank (up to 16): fills the compiled steps' cache, then
#   scripts/bench_call_cost.py at 2 ranks (numpy in and out of place, the torch binding) and at
#     8 and 16 ranks (numpy in place), 4 KiB to 16 MiB;
#   scripts/bench_scale.py at 8 and 16 ranks, 64 KiB to 16 MiB, with the shared allreduce also
#     in segments of SEGMENTS bytes (default 2, 4 and 16 MiB).
# Usage: bash scripts/call_cost_checks.sh [OUTDIR]   (default results/call_cost). Tables go to
# OUTDIR/call_cost_checks.log, bench_scale's results to OUTDIR/scale_N.json. CPU only; a rank
# count above the machine's cores is skipped, saying so. CALLS (500) and WARMUP (100): the
# timed and untimed calls per size of bench_call_cost.
set -u
cd "$(dirname "$0")/.."
out=${1:-results/call_cost}
mkdir -p "$out"
log="$out/call_cost_checks.log"
: > "$log"
export CUDA_VISIBLE_DEVICES= HORORING_SELECT_DEVICE=0
say() { echo "== $* ($SECONDS s)" | tee -a "$log"; }
say "$(nproc) cores; $(lscpu | grep -i 'model name' | sed 's/.*: *//')"
timeout 120 python -m hororing.algorithms.compiled --jobs "$(nproc)" 2>&1 | tail -1 >> "$log"
for spec in "2 numpy" "2 numpy-out" "2 torch" "8 numpy" "16 numpy"; do
    set -- $spec
    [ "$1" -le "$(nproc)" ] || { say "skipped $1 ranks: fewer cores"; continue; }
    say "bench_call_cost at $1 ranks, --api $2"
    timeout 120 mpiexec -n "$1" python scripts/bench_call_cost.py \
        --sizes 4KiB,64KiB,1MiB,16MiB --calls "${CALLS:-500}" --warmup "${WARMUP:-100}" \
        --api "$2" >> "$log" 2>&1 || say "exit $?"
done
for ranks in 8 16; do
    [ "$ranks" -le "$(nproc)" ] || { say "skipped $ranks ranks: fewer cores"; continue; }
    say "bench_scale at $ranks ranks"
    timeout 240 mpiexec -n "$ranks" python scripts/bench_scale.py --min-bytes 65536 \
        --max-bytes 16777216 --factor 4 --rounds 3 --min-calls 3 \
        --shared-segments "${SEGMENTS:-2097152,4194304,16777216}" \
        --json "$out/scale_$ranks.json" >> "$log" 2>&1 || say "exit $?"
done
say "done"
