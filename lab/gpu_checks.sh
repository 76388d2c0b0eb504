#!/usr/bin/env bash
# The measurements that need a GPU, each as one prepared call that writes its results under $OUT (at most 8 files:
# logs are packed into one archive) and prints a short table last. A session lent a GPU runs one of them:
#
#   bash lab/gpu_checks.sh bench       # the kernel against SDPA, tuning, the training step (timeouts: 9.5 min at most)
#   bash lab/gpu_checks.sh claims12    # claims 1 and 2 with the guard's validity arms, paired seeds
#   bash lab/gpu_checks.sh claims37    # claims 3 to 7, a reduced dose grid
# None of this has run on a GPU yet: the times are the timeouts', not measurements. One 10-minute call holds the
# probe (under 2 min) and BUDGET seconds of runs: with the defaults, 8 paired seeds of a few arms. The report says
# "inconclusive" where too few seeds ran for any sign test to reach p < 0.05, and counts runs cut off against their
# claims: a session that gets more GPU time raises BUDGET and runs the rest.
#   TINY=1 bash lab/gpu_checks.sh claims12   # a dry run of the same steps on a CPU at tiny size (minutes)
#
# Knobs (environment): SEEDS (paired seeds per arm), PARALLEL (runs sharing the GPU; claims12 measures it first
# unless PARALLEL_SET=1), STEPS (--max-steps), BUDGET (seconds the sweep may take), ARMS (claims12's arms).
set -uo pipefail
cd "$(dirname "$0")/.."   # the repository root: the lab runs from there
MODE=${1:?give bench, claims12 or claims37}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d .cache/tiktoken ] && export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-$PWD/.cache/tiktoken}
if [ "${TINY:-0}" = 1 ]; then
    EXTRA=(--max-steps 3 --n-layer 1 --n-head 2 --n-embd 32 --block-size 32 --batch-size 2 --eval-iters 1
           --log-interval 1 --device cpu --attn-impl torch)
    SEEDS=${SEEDS:-2}; PARALLEL=${PARALLEL:-2}; BUDGET=${BUDGET:-600}
else
    EXTRA=(--max-steps "${STEPS:-1200}")
    SEEDS=${SEEDS:-8}; PARALLEL=${PARALLEL:-16}; BUDGET=${BUDGET:-380}
fi
(nvidia-smi -L 2>/dev/null || echo "no GPU: $(uname -m) CPU") > "$OUT/machine.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/machine.txt"

probe() {   # how many runs share the GPU: N runs of 30 steps side by side, for N in 1 8 16; tokens/s each
    for n in 1 8 16; do
        timeout -k 5 40 python -m lab.sweep --claims 1 --only fp32 --seeds "$n" --parallel "$n" --out-root "runs/probe$n" \
            -- "${EXTRA[@]}" --max-steps 30 --log-interval 10 > /dev/null 2>&1   # the last flag given wins
        python - "$n" <<'PY' >> "$OUT/probe.txt"
import glob, json, statistics, sys
n = sys.argv[1]
rates = [[json.loads(l)["tokens_per_s"] for l in open(p) if '"tokens_per_s"' in l][-1]
         for p in glob.glob(f"runs/probe{n}/fp32/seed*/log.jsonl")]
print(n, round(statistics.median(rates)), round(sum(rates)))
PY
    done
    # the most runs side by side whose each keeps 60% of a lone run's speed
    PARALLEL=$(awk 'NR == 1 {one = $2} $2 >= 0.6 * one {n = $1} END {print n}' "$OUT/probe.txt")
    echo "runs side by side: $PARALLEL (columns: runs, median tokens/s per run, total)" >> "$OUT/probe.txt"
}

sweep() {   # sweep.py within BUDGET seconds, then the report, the plots and every run's log in one archive
    local root=runs/$MODE
    timeout -k 30 "$BUDGET" python -m lab.sweep --seeds "$SEEDS" --parallel "$PARALLEL" --out-root "$root" "$@" \
        -- "${EXTRA[@]}" > "$OUT/sweep.txt" 2>&1
    echo "sweep exit $? (124: cut off at ${BUDGET} s)" >> "$OUT/sweep.txt"
    python -m lab.report "$root" --markdown "$OUT/RESULTS.md" --plots "$root/plots" > "$OUT/report.txt" 2>&1
    tar czf "$OUT/runs.tar.gz" --exclude='ckpt.pt*' "$root"      # the logs and plots: report.py re-reads them
    grep -E "^(claim|[0-9]+v?\+? )" "$OUT/report.txt" | cut -c1-110 | head -40
}

case "$MODE" in
bench)
    timeout 90 python -m lab.bench --only check > "$OUT/check.txt" 2>&1
    if [ "${TINY:-0}" = 1 ]; then
        python -m lab.bench --smoke --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
    else
        timeout 180 python -m lab.bench --only tune > "$OUT/tune.txt" 2>&1
        timeout 300 python -m lab.bench --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
    fi
    tail -n 12 "$OUT/bench.txt"
    ;;
claims12)
    python prepare_data.py > "$OUT/prepare.txt" 2>&1
    [ -z "${PARALLEL_SET:-}" ] && probe
    sweep --claims 1,2 --only "${ARMS:-bf16,fp32,bf16-guard,bf16-qknorm-always}"   # then safemax, fp32-guard
    ;;
claims37)
    python prepare_data.py > "$OUT/prepare.txt" 2>&1
    # the grid's two upper doses (in the CPU lab only they moved anything), then every arm of claims
    # 5 to 7 (from sweep.py, so none is missed) but the source's own fp32-accum fix, which is reported only,
    # and claim 6's long-horizon arms, which set --max-steps themselves (a GPU session with time runs them)
    arms=$(python -c "from lab import sweep; print(','.join(dict.fromkeys([n for n in sweep.experiments([3, 4])
        if not n.startswith('inject-') or any(f'-{d:g}-c' in n for d in sweep.DOSES[1:])]
        + [n for n in sweep.experiments([5, 6, 7]) if n != 'bf16-guard-fp32-accum' and n not in sweep.long_arms('bf16')])))")
    sweep --claims 3,4,5,6,7 --only "$arms"
    ;;
*)
    echo "unknown mode $MODE: give bench, claims12 or claims37" >&2; exit 2
    ;;
esac
