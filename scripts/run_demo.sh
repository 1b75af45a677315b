#!/usr/bin/env bash
# The local CPU demo of the main job: set up .venv if needed, then pretrain the tiny GPT on 4 gloo
# ranks (TP=2 x DP=2) with all three plugins switched on by scripts/presets/ds_cpu_local.json.
# Extra arguments go to scripts/pretrain_gpt.py (e.g. --train-iters 50, --save DIR).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
nproc=${NPROC:-4}
# The preset holds one Megatron flag set; comments start with '#'.
mapfile -t preset < <(sed -e 's/#.*//' scripts/presets/tiny-cpu.args | tr -s ' \t' '\n' | sed '/^$/d')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m torch.distributed.run --nproc-per-node "$nproc" --master-port "${MASTER_PORT:-29511}" \
  scripts/pretrain_gpt.py "${preset[@]}" \
  --deepspeed-config "${CONFIG:-scripts/presets/ds_cpu_local.json}" \
  --data-cache-path "${DATA_CACHE:-$root/runs/data}" "$@"
