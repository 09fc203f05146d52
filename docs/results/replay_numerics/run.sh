# A bf16 demo run replayed with the config's name (--config demo, one learner thread) instead of
# the run's saved config (two threads): the replay takes the recorded numerics. 2-core AMD EPYC
# VM with AVX512-BF16 (no AMX), from a clean clone of 569922c, 2026-12-07.
heterorl train --config demo --out /tmp/nu/run --data-dir /tmp/nu/stack --keep-stack \
    --set learner.max_steps=10 --set eval.every=null
RUN=$(python -c "import json; print(json.load(open('/tmp/nu/run/summary.json'))['run'])")
eval "$(heterorl env --data-dir /tmp/nu/stack)"
heterorl replay --config demo --data-dir /tmp/nu/stack --source kafka:///$RUN.rollouts \
    --base s3://heterorl/$RUN/v0/ --out /tmp/nu/replay --exact-batches --set eval.every=null \
    --set learner.max_steps=10
# then: the original's published v10 against the replay's checkpoints/v10, tensor by tensor
