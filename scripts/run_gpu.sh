#!/usr/bin/env bash
# On a machine with one CUDA (or ROCm) GPU: the GPU tests (tests/gpu), then the GPU benchmarks
# (sliced GEMMs, the loader's GPU path, the main job with and without plugins). Everything lands in
# benchmarks/results/gpu/ (or $RESULTS): test log, JSON and markdown per benchmark.
# PYTHON=/path/to/python uses an existing environment (torch with CUDA, deepspeed 0.19, megatron-core
# 0.16); without it, .venv is set up as for the tests. Exit code: non-zero if any step failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ -n "${PYTHON:-}" ]; then
  py=$PYTHON
else
  bash scripts/setup_env.sh || exit 1
  py=.venv/bin/python
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
out=${RESULTS:-benchmarks/results/gpu}
mkdir -p "$out"
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "error: no GPU is visible: run this on a GPU node")' || exit 2
failed=0
step() { echo "== $*"; "$@" || { echo "== FAILED: $*"; failed=1; }; }
step "$py" -m pytest tests/gpu -v -s -p no:cacheprovider > >(tee "$out/tests.log") 2>&1
step "$py" -m benchmarks.gpu.sliced_gemm --out "$out"
step "$py" -m benchmarks.gpu.loader_cuda --out "$out"
step "$py" -m benchmarks.gpu.main_job --out "$out"
exit $failed
