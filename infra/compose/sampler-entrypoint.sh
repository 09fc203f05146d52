#!/bin/sh
# A compose sampler replica: claims one key of the pool in /keys/samplers/ (each replica its own:
# two processes signing with one key would reuse its sequence numbers and be quarantined), and
# runs as the sampler that key was registered for (its file name: /keys/samplers/<id>.key).
# The claim is a lock held by this process on the shared volume /claims: it ends with the
# process, so a restarted or re-scaled replica takes any free key. docs/deployment.md, section 2.
set -eu
CONFIG=${1:?usage: sampler-entrypoint.sh CONFIG [--set KEY=VALUE ...]}
shift
mkdir -p /claims
for key in /keys/samplers/*.key; do
  [ -f "$key" ] || continue
  id=$(basename "$key" .key)
  exec 9>"/claims/$id.lock"
  if flock -n 9; then
    echo "sampler-entrypoint: running as sampler $id" >&2
    exec heterorl sampler --config "$CONFIG" --id "$id" --key "$key" \
      --set security.learner_public_key=/keys/learner.pub "$@"
  fi
  exec 9>&-
done
echo "sampler-entrypoint: every sampler key in /keys/samplers/ is taken: register more (heterorl keys add ID --out keys/samplers/ID.key) or scale down" >&2
exit 2
