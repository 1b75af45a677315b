#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent; seconds when current).
# torch goes in first and pinned: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
stamp="$venv/.setup-stamp"
want=$(cat "$root/setup.py" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)
# DeepSpeed's CPU backend JIT-builds its shared-memory op in every process that starts it, behind a
# lock file that later processes wait on without a bound. The test and demo commands point
# TORCH_EXTENSIONS_DIR here; the op is built once below. A lock older than 10 minutes (a build takes
# about 20 s on 2 cores) was left by a killed build and would hang every later process.
extensions="$venv/torch_extensions"
if [ -d "$extensions" ]; then
  find "$extensions" -name lock -mmin +10 -printf 'removing a stale build lock: %p\n' -delete
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import deepspeed_ext" 2>/dev/null; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}"
DS_BUILD_OPS=0 "${pip[@]}" "deepspeed==0.19.8" "megatron-core==0.16.1"
"${pip[@]}" -e "$root[test,upstream]"
# Built with the venv's bin first on PATH, as the test and demo commands run everything: the venv's
# ninja (pip's) and the system's hash build commands differently, so a process finding the other one
# rebuilt the op (about 30 s, every rank waiting on the lock) each time the two kinds alternated.
PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$extensions" timeout 600 "$venv/bin/python" - <<'PY'
import deepspeed.ops
from deepspeed.accelerator import get_accelerator

builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load()
PY
echo "$want" >"$stamp"
echo "environment ready: $venv"
