"""`heterorl loadtest`: how far one learner, one Redis and one broker scale (docs/loadtest.md).

- `fleet`: the modeled hardware (a fleet profile's classes, generation by tokens/s) and the
  simulated samplers, which run the product's sampler code (`producers.sampler.Sampler`)
  for everything but the model;
- `learner`: the product's learner (`consumers.learner.Learner`) with its optimizer step and
  its model-sized checks modeled by their time;
- `worker`: a process that hosts many simulated samplers, each behind its own fault-proxy link;
- `rig`: one measured case (a fleet of N, async or lock-step) on the local stack;
- `report`: the rows, the named bottleneck, `loadtest.json` and the PNG.
"""
