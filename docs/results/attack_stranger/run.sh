#!/bin/bash
cd /work/main
for i in 1 2; do
  for arm in stranger baseline; do
    extra=""; [ $arm = baseline ] && extra="--no-stranger"
    /usr/bin/time -f "%e s" .venv/bin/heterorl attack --config demo --minutes 2 --validators 1 $extra \
      --out /work/runs/pace/$arm-$i --data-dir /work/runs/pace/data \
      --set model.warmup_target_accuracy=0.1 --set learner.precision=fp32 --set sampler.precision=fp32 \
      > /work/runs/pace/$arm-$i.log 2>&1
    echo "$arm-$i exit $?" >> /work/runs/pace/done.txt
  done
done
