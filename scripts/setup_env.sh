#!/usr/bin/env bash
# Create or refresh the project's virtual environment in .venv (idempotent; seconds when current).
# torch goes in first and pinned: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
stamp="$venv/.setup-stamp"
want=$(cat "$root/setup.py" "$root/scripts/setup_env.sh" | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import deepspeed_ext" 2>/dev/null; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}"
DS_BUILD_OPS=0 "${pip[@]}" "deepspeed==0.19.8" "megatron-core==0.16.1"
"${pip[@]}" -e "$root[test,upstream]"
echo "$want" >"$stamp"
echo "environment ready: $venv"
