#!/usr/bin/env bash
# Cells of `heterorl study delay --config smollm2_study` side by side on one GPU machine that has
# no package registry and no model hub (docs/performance.md, "On one GPU"), keeping every cell
# that finishes before the deadline.
#
#   here:  python bench/gpu_pack.py parts              # .gpu/p1, p2, ... (wheels + model)
#   there: python3 bench/gpu_pack.py stage .gpu/pN     # one call per part, each carrying one
#          bash bench/gpu_study.sh run SECONDS         # then the cells
#
# CELLS (default: gepo and gspo at max delay 0 and 32, seed 1) are LOSS:DELAY:SEED words; each
# cell is its own `heterorl study delay` with its own local stack (--data-dir), all sharing one
# converted model, and is exactly the cell that command runs on a CPU (same config text, so
# `--report-only` reads it beside the others). What the cells wrote (metrics, summaries, logs;
# no weights) comes back as $OUT/gpu_study.tgz, finished or not.
set -u
mode=${1:?"usage: bench/gpu_study.sh run SECONDS"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
[ "$mode" = run ] || { echo "usage: bench/gpu_study.sh run SECONDS (pack and stage with bench/gpu_pack.py)" >&2; exit 2; }

DEADLINE=${2:?seconds}
CELLS=${CELLS:-"gepo:0:1 gepo:32:1 gspo:0:1 gspo:32:1"}
R=/tmp/gpu_study; rm -rf /tmp/data "$R"
OUTDIR=${OUT:-/tmp/gpu_out}
mkdir -p "$R/logs" "$OUTDIR"
pack() { tar czf "$OUTDIR/gpu_study.tgz" --exclude='.learner-*' --exclude='*.safetensors' --exclude='*.pt' -C /tmp gpu_study; ls -l "$OUTDIR"; }
trap pack EXIT
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
SITE=$(python3 "$ROOT/bench/gpu_pack.py" unpack) || exit 1
export PYTHONPATH=$SITE:$ROOT PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from pipeline.models.sources import resolve_model; print(resolve_model('smollm2-135m-instruct', '/tmp/models'))" \
  2>&1 | tee "$R/logs/convert.log" | tail -2
echo "t=$(el)s model ready; $(nvidia-smi -L | head -1); $(nproc) cores; $(df -h /tmp | tail -1)"
for c in $CELLS; do
  IFS=: read -r loss d seed <<<"$c"
  name=$loss-d$d-s$seed; dd=/tmp/data/$name
  mkdir -p "$dd"; ln -sfn /tmp/models "$dd/models"
  timeout -k 20 -s TERM $((DEADLINE - $(el))) python3 -m heterorl study delay --config smollm2_study \
    --losses "$loss" --max-delays "$d" --seeds "$seed" --data-dir "$dd" \
    --out "$R/$name" > "$R/logs/$name.log" 2>&1 &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do
  sleep 30
  line="t=$(el)s"
  for f in "$R"/*/cells/*/metrics.jsonl; do
    [ -f "$f" ] && line="$line $(basename "$(dirname "$f")"):$(grep -c '"kind": "learner"' "$f")"
  done
  echo "$line | gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) | disk $(df -h /tmp | awk 'NR==2{print $3}')"
done
wait
echo "t=$(el)s all cells ended"
for f in "$R"/logs/*.log; do echo "== $f"; tail -4 "$f"; done
