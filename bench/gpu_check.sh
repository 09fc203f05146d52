#!/usr/bin/env bash
# The product on one NVIDIA GPU, one command: `make gpu-check` after `make install` (which installs
# PyTorch's CUDA build where nvidia-smi lists a GPU). docs/performance.md, "On one GPU".
#
#   bash bench/gpu_check.sh [--python PY] [--pack DIR] [--dry-run] [RESULTS_DIR] [-- RACE ARGS ...]
#
# 1. bench/gpu_preflight.py: the Python, torch (version, CUDA build or CPU build, the GPU it sees),
#    transformers, every module of the repository imported, the precision `precision: auto` picks,
#    SmolLM2's GGUF file. --dry-run stops after it (no GPU needed); otherwise no CUDA GPU stops here.
# 2. The race: bench/async_vs_sync.py --config smollm2 --steps 200 --eval-every 100
#    --set eval.problems=200 (RACE ARGS replace these; 200 steps, so that start-up does not decide
#    it): `heterorl train` end to end, then a plain single-process loop of the same algorithm, then
#    TRL's GRPOTrainer where trl is installed (--trl), with nvidia-smi's utilization sampled meanwhile.
# 3. bench/run_digest.py on the product's run (RESULTS_DIR/digest.txt).
# 4. bench/gpu_check_summary.py (RESULTS_DIR/summary.txt): the race's minutes, the learner's share
#    outside its optimizer step, the GPU's utilization, the on-policy learner-sampler mismatch of
#    the precision `auto` picked, whether the publisher kept up (versions_skipped), whether the
#    samplers kept the learner fed (its share of time waiting, each sampler's time per batch).
#
# PY: --python, else $PYTHON, else .venv/bin/python where it exists, else python3. The packed way,
# for a machine that reaches no package registry (its python3 has torch): bench/gpu_pack.py's parts
# staged into DIR, then `--pack DIR`, which unpacks them (gpu_pack.py unpack --dir DIR) and runs on
# that site with the machine's python3. RESULTS_DIR: the race's JSON and PNG, the product run's
# summaries, metrics and logs (default $OUT/gpu_check where OUT is set, else runs/gpu_check-TIME).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-}
PACK=""
DRY=0
RESULTS=""
RACE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY=$2; shift 2 ;;
    --pack) PACK=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --) shift; RACE=("$@"); break ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (--help)" >&2; exit 2 ;;
    *) RESULTS=$1; shift ;;
  esac
done
if [ -z "$PY" ]; then
  if [ -z "$PACK" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
if [ ${#RACE[@]} -eq 0 ]; then
  RACE=(--config smollm2 --steps 200 --eval-every 100 --set eval.problems=200)
  "$PY" -c "import trl" 2>/dev/null && RACE+=(--trl)
fi
RESULTS=${RESULTS:-${OUT:+$OUT/gpu_check}}
RESULTS=${RESULTS:-$ROOT/runs/gpu_check-$(date +%Y%m%d-%H%M%S)}
t0=$(date +%s)
say() { echo "[gpu_check t=$(( $(date +%s) - t0 ))s] $*"; }

if [ -n "$PACK" ]; then
  SITE=$("$PY" "$ROOT/bench/gpu_pack.py" unpack --dir "$PACK")
  export PYTHONPATH="$SITE:$ROOT"
  say "the pack unpacked in $SITE"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpus=$(nvidia-smi -L 2>/dev/null | head -1 || true)
say "1/4 preflight with $PY; ${gpus:-nvidia-smi lists no GPU}; $(nproc) cores"
need=(--need-gpu)
[ "$DRY" = 1 ] && need=()
set +e
"$PY" "$ROOT/bench/gpu_preflight.py" ${need[@]+"${need[@]}"}
code=$?
set -e
if [ "$DRY" = 1 ] || [ "$code" != 0 ]; then
  say "preflight exited with $code$([ "$DRY" = 1 ] && echo ' (--dry-run: nothing else runs)')"
  exit "$code"
fi

mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
say "2/4 the race: bench/async_vs_sync.py ${RACE[*]} --out $RESULTS/race"
set +e
(cd "$ROOT" && "$PY" bench/async_vs_sync.py "${RACE[@]}" --out "$RESULTS/race") 2>&1 \
  | grep --line-buffered -v -E '^\s*$|it/s\]$|s/it\]$' | tee "$RESULTS/race.log"
code=${PIPESTATUS[0]}
set -e
say "the race exited with $code"
run="$RESULTS/race/async"
if [ -d "$run" ]; then
  say "3/4 the product's run ($run)"
  "$PY" "$ROOT/bench/run_digest.py" "$run" | tee "$RESULTS/digest.txt" || true
  [ -d "$run/logs" ] && tar czf "$RESULTS/logs.tgz" -C "$run" logs && rm -rf "$run/logs"
  rm -rf "$run/final_policy" "$run"/.learner-* "$run/tb"
fi
if [ "$code" = 0 ]; then
  say "4/4 summary ($RESULTS/summary.txt)"
  "$PY" "$ROOT/bench/gpu_check_summary.py" "$RESULTS/race" | tee "$RESULTS/summary.txt" || code=1
fi
du -sh "$RESULTS"
exit "$code"
