#!/usr/bin/env bash
# Two Ray nodes on one host, the second with its own HOME and working dir (docs/cluster.md);
# then joins them with a short async run of the tiny model. `ray stop` ends both.
set -euo pipefail
PORT=${PORT:-6380}
ray start --head --port "$PORT" --num-cpus 0 --include-dashboard false
NODE_HOME=$(mktemp -d)
(cd "$NODE_HOME" && HOME=$NODE_HOME ray start --address "127.0.0.1:$PORT" --num-cpus 1)
RAY_ADDRESS=127.0.0.1:$PORT turnrl train --run.mode async --model.name tiny --run.steps 2 \
  --ray.num_workers 1 --rollout.group_size 2 --rollout.groups_per_step 2 --eval.episodes 0 "$@"
