#!/usr/bin/env bash
# The CPU scaling measurements, for a machine with at least 16 cores (no oversubscription):
#   scripts/bench_allreduce.py at 2, 4, 8 and 16 ranks (hororing's ring, MPI_Allreduce and the
#   plain Python ring from 1 KiB to 64 MiB, each row beside the ring cost model's prediction),
#   scripts/bench_negotiation.py at the same sizes, then scripts/bench_ring_vs_ps.py with
#   2, 4, 8 and 14 workers (plus 2 server ranks: at most 16 ranks).
# Usage: bash scripts/cpu_scaling.sh [OUTDIR]   (default results/cpu). Tables go to
# OUTDIR/cpu_scaling.log, results to OUTDIR/allreduce_N.json, negotiation.jsonl and ring_vs_ps.json.
set -u
cd "$(dirname "$0")/.."
out=${1:-results/cpu}
mkdir -p "$out"
log="$out/cpu_scaling.log"
: > "$log"
echo "== $(nproc) cores" | tee -a "$log"
for ranks in 2 4 8 16; do
    echo "== bench_allreduce at $ranks ranks" | tee -a "$log"
    timeout 240 mpiexec -n "$ranks" python scripts/bench_allreduce.py --min-bytes 1024 \
        --max-bytes $((64 * 1024 * 1024)) --algorithms ring native plain \
        --json "$out/allreduce_$ranks.json" >> "$log" 2>&1 || echo "== exit $?" | tee -a "$log"
done
for ranks in 2 4 8 16; do
    echo "== bench_negotiation at $ranks ranks" | tee -a "$log"
    timeout 120 mpiexec -n "$ranks" python scripts/bench_negotiation.py \
        --json "$out/negotiation.jsonl" >> "$log" 2>&1 || echo "== exit $?" | tee -a "$log"
done
echo "== bench_ring_vs_ps" | tee -a "$log"
timeout 600 python scripts/bench_ring_vs_ps.py --ns 2,4,8,14 --servers 2 \
    --json "$out/ring_vs_ps.json" >> "$log" 2>&1 || echo "== exit $?" | tee -a "$log"
echo "== done" | tee -a "$log"
