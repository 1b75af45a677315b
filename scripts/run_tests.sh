#!/usr/bin/env bash
# Set up .venv if needed, lint, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/setup_env.sh
# DeepSpeed's CPU op builds go where the set-up script built them (see there), not to ~/.cache.
export TORCH_EXTENSIONS_DIR="$root/.venv/torch_extensions"
# The venv first on PATH (as when activated): one ninja for every process that loads that op.
export PATH="$root/.venv/bin:$PATH"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Static types of the libraries (what and how: [tool.mypy] in pyproject.toml).
.venv/bin/mypy
# The project's modules as bytecode, once: where PYTHONDONTWRITEBYTECODE is set (CI's machine sets
# it), each of the hundreds of processes the tests start would compile them from source again.
.venv/bin/python -m compileall -q mdsp_base deepspeed_ext megatron_ext multirank benchmarks scripts tests
# pytest exits 5 when it collects nothing: that is a failure here, as is any other non-zero code.
.venv/bin/python -m pytest "$@"
# The whole suite's numeric tests once more with oneDNN held to AVX2: their bounds come from the
# rounding, so they must hold whichever bf16 GEMM kernel (AVX2, AVX-512, AMX) the CPU gets.
if (($# == 0)); then
  ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python -m pytest -m numeric
fi
