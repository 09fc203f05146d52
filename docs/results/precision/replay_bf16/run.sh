#!/bin/bash
# The demo in the precision auto picks here, then replay --exact-batches from its v0; compare the final weights.
set -e
cd "$(dirname "$0")/../../../.."  # the repository root
H=.venv/bin/heterorl
D=${OUT:-runs/replay_bf16}/data  # a local stack of its own
$H train --config demo --data-dir $D --out ${OUT:-runs/replay_bf16}/orig --keep-stack
RUN=$(python3 -c "import json; print(json.load(open('${OUT:-runs/replay_bf16}/orig/summary.json'))['run'])")
FINAL=$(python3 -c "import json; print(json.load(open('${OUT:-runs/replay_bf16}/orig/summary.json'))['final_policy_version'])" 2>/dev/null || echo "")
echo RUN $RUN FINAL $FINAL
$H replay --config ${OUT:-runs/replay_bf16}/orig/config.yaml --data-dir $D --source kafka:///$RUN.rollouts --base s3://heterorl/$RUN/v0/ --out ${OUT:-runs/replay_bf16}/exact --exact-batches --set eval.every=null
echo REPLAY-DONE
# the original's final version, fetched and verified, against the replay's
$H weights fetch --config ${OUT:-runs/replay_bf16}/orig/config.yaml --data-dir $D --out ${OUT:-runs/replay_bf16}/orig_v100 s3://heterorl/$RUN/v100/
.venv/bin/python docs/results/precision/replay_bf16/compare.py ${OUT:-runs/replay_bf16}/orig_v100 ${OUT:-runs/replay_bf16}/exact/checkpoints/v100
$H down --data-dir $D
