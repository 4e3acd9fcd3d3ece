#!/usr/bin/env bash
# The scale model's measurements with a core per rank (a machine with at least 16 cores):
# scripts/bench_scale.py at 2, 3, 4, 6, 8, 12 and 16 ranks on one host, then
# scripts/simulate_scale.py --calibrate on them (measured against the fitted model, per
# algorithm, size and rank count).
# Usage: bash scripts/scale_checks.sh [OUTDIR [RANKS ...]]   (default results/scale).
# Tables go to OUTDIR/scale_checks.log, results to OUTDIR/scale_shm_N.json, the fit to
# OUTDIR/scale_fit.json and the comparison to OUTDIR/scale_validation.json (SCALE_CALIBRATE=0:
# no calibration here; run it elsewhere on the JSON files).
set -u
cd "$(dirname "$0")/.."
out=${1:-results/scale}
shift || true
ranks_list=("$@")
[ ${#ranks_list[@]} -gt 0 ] || ranks_list=(2 3 4 6 8 12 16)
mkdir -p "$out"
log="$out/scale_checks.log"
: > "$log"
echo "== $(nproc) cores" | tee -a "$log"
files=()
for ranks in "${ranks_list[@]}"; do
    if [ "$ranks" -gt "$(nproc)" ]; then
        echo "== $ranks ranks: more than this machine's $(nproc) cores, skipped" | tee -a "$log"
        continue
    fi
    echo "== bench_scale at $ranks ranks" | tee -a "$log"
    if timeout 180 mpiexec -n "$ranks" python scripts/bench_scale.py --rounds 9 \
            --json "$out/scale_shm_$ranks.json" >> "$log" 2>&1; then
        files+=("$out/scale_shm_$ranks.json")
    else
        echo "== exit $?" | tee -a "$log"
    fi
done
if [ ${#files[@]} -gt 0 ] && [ "${SCALE_CALIBRATE:-1}" != 0 ]; then
    echo "== simulate_scale --calibrate" | tee -a "$log"
    timeout 300 python scripts/simulate_scale.py --calibrate "${files[@]}" \
        --fit "$out/scale_fit.json" --validation "$out/scale_validation.json" >> "$log" 2>&1 \
        || echo "== exit $?" | tee -a "$log"
fi
echo "== done" | tee -a "$log"
