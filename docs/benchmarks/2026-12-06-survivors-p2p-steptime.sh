#!/bin/bash
# step time of 3 replica groups x 2 processes (peer to peer, hub) vs one world of the 6 processes
set -u
out=${1:-/tmp/steptime}; steps=${STEPS:-25}
[ -e "$out" ] && { echo "$out exists: give a new folder"; exit 2; }; mkdir -p "$out"
# MODEL: the --set of the model (default: the 25.5M-parameter GPT of the first runs)
model=${MODEL:-"--set model.d_model=512 --set model.n_layers=8 --set model.d_mlp=2048 --set model.n_heads=8 --set model.seq_len=64 --set data.seq_len=64 --set data.global_batch=12"}
common="--recipe gpt_tiny --steps $steps --no-progress --set ckpt.every=0 --set ckpt.local_every=0 --set train.eval_every=0 $model"
gloo=${GLOO_SITE:?a folder holding torch (pip install --target DIR torch)}
for cfg in ${CONFIGS:-p2p hub world}; do
  args="--nproc 6 --devices-per-proc 1"
  env="PYTHONPATH=$PWD:$gloo"
  case $cfg in
    p2p) args="$args --groups 3 --min-groups 2";;
    hub) args="$args --groups 3 --min-groups 2"; env="$env JAXPAR_GROUP_EXCHANGE=hub";;
    world) ;;
  esac
  echo "== $cfg $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  env $env timeout 1200 python -m jaxpar.cli launch --run-dir $out/$cfg $args -- python -m train $common > $out/$cfg.log 2>&1
  echo "rc=$? $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  python - $out/$cfg <<'PY'
import json, sys, statistics
d = sys.argv[1]
ms = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
t = [m["step_time_s"] for m in ms[5:]]
s = json.load(open(f"{d}/summary.json")).get("groups", {})
print(f"steps {len(ms)} median step_time_s (steps 6+) {statistics.median(t):.3f} mean {statistics.mean(t):.3f} final loss {ms[-1]['loss']:.6f}", {k: s.get(k) for k in ("steps_peer_to_peer", "hub_gradient_bytes", "steps_released")})
PY
done
