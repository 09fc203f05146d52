#!/usr/bin/env bash
# The product against a plain loop on one NVIDIA GPU, from the repository: the race of
# bench/async_vs_sync.py on SmolLM2-135M-Instruct (`heterorl train --config smollm2` end to end
# against a single-process loop of the same algorithm), with the GPU's utilization beside the
# minutes of each, and where the learner's time went.
#
#   here:  python bench/gpu_pack.py parts                 # .gpu/p1, p2, ... (wheels + model)
#   there: python3 bench/gpu_pack.py stage .gpu/pN        # one call per part, each carrying one
#          bash bench/gpu_check.sh [RESULTS_DIR] [-- RACE ARGS ...]
#
# For a machine with one NVIDIA GPU whose `python3` holds torch and transformers and nothing of
# this project's: no package registry, no model hub (bench/gpu_image_packages.txt lists what its
# image had). RESULTS_DIR (default $OUT/gpu_check, else ./gpu_check) receives the race's JSON and
# PNG, the product run's summary, metrics, report and logs. docs/performance.md, "On one GPU".
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
RESULTS=${1:-${OUT:-.}/gpu_check}
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
RACE=("$@")
[ ${#RACE[@]} -eq 0 ] && RACE=(--config smollm2 --steps 40 --eval-every 20 --set eval.problems=200)
PY=${PYTHON:-python3}
t0=$(date +%s)
say() { echo "[gpu_check t=$(( $(date +%s) - t0 ))s] $*"; }

SITE=$("$PY" "$ROOT/bench/gpu_pack.py" unpack)
export PYTHONPATH="$SITE:$ROOT" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say "packages ready in $SITE; $(nvidia-smi -L 2>/dev/null | head -1); $(nproc) cores"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
mkdir -p "$RESULTS"
set +e
(cd "$ROOT" && "$PY" bench/async_vs_sync.py "${RACE[@]}" --out "$RESULTS/race") 2>&1 \
  | grep --line-buffered -v -E '^\s*$|it/s\]$|s/it\]$' | tail -n 80
code=${PIPESTATUS[0]}
set -e
say "the race exited with $code"
run="$RESULTS/race/async"
if [ -d "$run" ]; then
  "$PY" "$ROOT/bench/run_digest.py" "$run" || true
  [ -d "$run/logs" ] && tar czf "$RESULTS/logs.tgz" -C "$run" logs && rm -rf "$run/logs"
  rm -rf "$run/final_policy" "$run"/.learner-* "$run/tb"
fi
du -sh "$RESULTS"
exit "$code"
