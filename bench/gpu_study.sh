#!/usr/bin/env bash
# Cells of `heterorl study delay --config CONFIG` side by side on one GPU machine (docs/performance.md,
# "On one GPU"), keeping every cell that finishes before the deadline.
#
#   bash bench/gpu_study.sh run SECONDS [CONFIG] [--pack DIR]
#
# CONFIG: the study's config, a shipped name or a YAML file (default smollm2_study; e.g.
# smollm2_plateau for that study's cells). CELLS (default: gepo and gspo at max delay 0 and 32,
# seed 1) are LOSS:DELAY:SEED words; each cell is its own `heterorl study delay` with its own local
# stack (--data-dir), all sharing one converted model, and is exactly the cell that command runs on
# a CPU (same config text, so `--report-only` reads it beside the others). The Python: $PYTHON, else
# .venv/bin/python where `make install` made it, else python3; `--pack DIR` runs on the pack that
# bench/gpu_pack.py staged in DIR (a machine that reaches no package registry), with python3.
# GPU_STUDY_DIR (default /tmp/gpu_study) holds the cells' outputs and logs, GPU_STUDY_DIR.data their
# stacks (emptied first) and GPU_STUDY_DIR.models the converted model (kept for the next run). What
# the cells wrote (metrics, summaries, logs; no weights) comes back as $OUT/gpu_study.tgz ($OUT
# defaults to /tmp/gpu_out), finished or not.
set -u
usage="usage: bench/gpu_study.sh run SECONDS [CONFIG] [--pack DIR]"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PACK=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) PACK=${2:?"$usage"}; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ "${args[0]:-}" = run ] && [ ${#args[@]} -ge 2 ] && [ ${#args[@]} -le 3 ] || { echo "$usage" >&2; exit 2; }
DEADLINE=${args[1]}
CONFIG=${args[2]:-smollm2_study}
CELLS=${CELLS:-"gepo:0:1 gepo:32:1 gspo:0:1 gspo:32:1"}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -z "$PACK" ] && [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
R=${GPU_STUDY_DIR:-/tmp/gpu_study}; R=${R%/}; rm -rf "$R.data" "$R"
OUTDIR=${OUT:-/tmp/gpu_out}
mkdir -p "$R/logs" "$OUTDIR"
pack() { tar czf "$OUTDIR/gpu_study.tgz" --exclude='.learner-*' --exclude='*.safetensors' --exclude='*.pt' -C "$(dirname "$R")" "$(basename "$R")"; ls -l "$OUTDIR"; }
trap pack EXIT
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
if [ -n "$PACK" ]; then
  SITE=$("$PY" "$ROOT/bench/gpu_pack.py" unpack --dir "$PACK") || exit 1
  export PYTHONPATH=$SITE:$ROOT
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
"$PY" -c "from pipeline.models.sources import resolve_model; import sys; print(resolve_model('smollm2-135m-instruct', sys.argv[1]))" "$R.models" \
  2>&1 | tee "$R/logs/convert.log" | tail -2
echo "t=$(el)s model ready; config $CONFIG; $(nvidia-smi -L | head -1); $(nproc) cores; $(df -h "$R" | tail -1)"
for c in $CELLS; do
  IFS=: read -r loss d seed <<<"$c"
  name=$loss-d$d-s$seed; dd=$R.data/$name
  mkdir -p "$dd"; ln -sfn "$R.models" "$dd/models"
  timeout -k 20 -s TERM $((DEADLINE - $(el))) "$PY" -m heterorl study delay --config "$CONFIG" \
    --losses "$loss" --max-delays "$d" --seeds "$seed" --data-dir "$dd" \
    --out "$R/$name" > "$R/logs/$name.log" 2>&1 &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do
  sleep 30
  line="t=$(el)s"
  for f in "$R"/*/cells/*/metrics.jsonl; do
    [ -f "$f" ] && line="$line $(basename "$(dirname "$f")"):$(grep -c '"kind": "learner"' "$f")"
  done
  echo "$line | gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) | disk $(df -h "$R" | awk 'NR==2{print $3}')"
done
wait
echo "t=$(el)s all cells ended"
for f in "$R"/logs/*.log; do echo "== $f"; tail -4 "$f"; done
