#!/usr/bin/env bash
# Two Ray nodes on one host, the second with its own HOME and working dir (docs/cluster.md),
# joined by a short async run of the tiny model; extra arguments go to `turnrl train`.
# The nodes run with `ray start --block` under this script and are stopped by it (never
# `ray stop`, which would stop every Ray on the host). PYTHON picks the interpreter.
set -euo pipefail
PORT=${PORT:-6380}
PYTHON=${PYTHON:-python}
RAY="$PYTHON -m ray.scripts.scripts"
NODE_HOME=$(mktemp -d)
# Ray 2.5x+ turns token authentication on for `ray start --head` when ~/.ray/auth_token exists
# (any earlier local ray.init writes one) but not for processes joining by address: give every
# process here the same mode and token (a node with its own HOME has no ~/.ray of its own).
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$($PYTHON -c "import secrets; print(secrets.token_hex(32))")}
export RAY_AUTH_TOKEN
RUN_DIR=${RUN_DIR:-$(mktemp -d)/run}
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$NODE_HOME"
}
trap cleanup EXIT

$RAY start --head --port "$PORT" --num-cpus 0 --include-dashboard false --block \
  > "$NODE_HOME/head.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do  # the head answers on its port once up
  (echo > "/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break
  sleep 1
done
(cd "$NODE_HOME" && HOME=$NODE_HOME exec $RAY start --address "127.0.0.1:$PORT" --num-cpus 1 \
  --block > "$NODE_HOME/node.log" 2>&1) &
pids+=($!)

start=$(date +%s)
RAY_ADDRESS=127.0.0.1:$PORT $PYTHON -m turnrl.cli train --run.mode async --model.name tiny \
  --run.steps 2 --ray.num_workers 1 --rollout.group_size 2 --rollout.groups_per_step 2 \
  --eval.episodes 0 --run.progress false --run.out_dir "$RUN_DIR" "$@"
echo "two_nodes.sh: trained in $(( $(date +%s) - start )) s; run directory $RUN_DIR"
