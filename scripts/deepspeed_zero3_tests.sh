#!/usr/bin/env bash
# DeepSpeed's own unit tests, run on CPU (gloo) with every ZeRO-3 engine they build replaced by the
# hierarchical variant (tests/deepspeed_contract/hz_contract.py).
#
#   scripts/deepspeed_zero3_tests.sh DEEPSPEED_CHECKOUT [OUT_DIR] [-- PYTEST_ARGS...]
#
# DEEPSPEED_CHECKOUT: a DeepSpeed source tree (its tests/ at the tag of the installed version).
# OUT_DIR (default: a new temporary directory): results.jsonl (one line per test: outcome, variant
# engines built, refusals, error), pytest.log, and a summary printed at the end.
# PYTEST_ARGS: test ids relative to the checkout's tests/ (default: the ZeRO-3 selection below).
# HZ_CONTRACT_SECONDARY_LEVEL=auto|package|node picks the variant's secondary level (default auto);
# HZ_CONTRACT_INIT=stock keeps DeepSpeed's zero.Init (default: the variant's Init);
# HZ_CONTRACT_VARIANT=off runs the same tests on stock ZeRO-3 (the baseline for a failure);
# with it, HZ_CONTRACT_STOCK_HPZ=<size> adds zero_hpz_partition_size=<size> to their ZeRO-3 configs
# (stock hpZ: the baseline for a difference the variant shares with hpZ).
# A test's zero_hpz_partition_size becomes the variant's secondary_level of that size.
# HZ_CONTRACT_CPU_FP16=1 (default) runs fp16 configs on a CPU whose oneDNN lacks fp16 (DeepSpeed's CPU
# accelerator refuses them there; torch's CPU kernels run them); 0 leaves DeepSpeed's check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
checkout=${1:?usage: $0 DEEPSPEED_CHECKOUT [OUT_DIR] [-- PYTEST_ARGS...]}
shift
if [[ $# -gt 0 && $1 != "--" ]]; then
    out=$1
    shift
else
    out=$(mktemp -d -t deepspeed-contract.XXXXXX)
fi
[[ ${1:-} == "--" ]] && shift
tests=$(cd "$checkout/tests" && pwd) || {
    echo "no tests/ in $checkout: pass a DeepSpeed source checkout" >&2
    exit 2
}
mkdir -p "$out"
out=$(cd "$out" && pwd)
: >"$out/results.jsonl"
: >"$out/events.jsonl"

selection=("$@")
if [[ ${#selection[@]} -eq 0 ]]; then
    # The ZeRO-3 cases (test ids of DeepSpeed 0.19.x): checkpoints, the fp32 consolidation,
    # GatheredParameters, zero.Init, accumulation, leaf modules, frozen weights, gradient clipping
    selection=(
        "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_immediate_save_load[3]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_load_immediate_save[3]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase::test_save_before_accum_grad_is_done[3]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_optimizer_state[3-False-Adam]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_not_load_optimizer_state[3-False-Adam]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint::test_load_module_only[3]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_optimizer_state[3]"
        "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpointFrozenWeights::test_load_module_only[3]"
        "unit/v1/zero/test_zero.py::TestZeroToFP32::test_1_param_group[False-3]"
        "unit/v1/zero/test_zero.py::TestZeroToFP32::test_2_param_groups[False-3]"
        "unit/v1/zero/test_zero.py::TestZero3RepeatForwardLoop"
        "unit/v1/zero/test_zero.py::TestZero3DictFwd::test[dict]"
        "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_model_class[EltwiseMultiplicationTestNetwork_Dict]"
        "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningBase::test_reduce_scatter[True]"
        "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningLargeParam"
        "unit/v1/zero/test_zero.py::TestZero3ParamPartitioningManyParams::test[False]"
        "unit/v1/zero/test_zero.py::TestZero3InitForParentWeightInitialization"
        "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount::test[3]"
        "unit/v1/zero/test_zero.py::TestZeroFrozenWeights::test[3]"
        "unit/v1/zero/test_zero.py::TestZeroUnbalancedGradients::test[3]"
        "unit/v1/zero/test_zero.py::TestZeroPartitionCache"
        "unit/v1/zero/test_zero.py::TestZero3SwitchModes::test[0.5]"
        "unit/v1/zero/test_zero.py::TestZero3ClientModuleID"
        "unit/v1/zero/test_zero.py::TestParamPartitioningSkipInit"
        "unit/v1/zero/test_zero.py::TestIncorectAllgatherBucketSize"
        "unit/runtime/zero/test_zero_leaf_module.py::TestSetZ3LeafModule"
        "unit/runtime/zero/test_zero_leaf_module.py::TestZ3LeafOptimization::test_finegrained_optimization[100]"
        "unit/runtime/zero/test_zero_grad_clip.py"
        "unit/runtime/zero/test_zero_context.py::TestZeroGatheredParametersFree"
        "unit/runtime/zero/test_zero_context.py::TestGatherUpdate"
        "unit/v1/zero/test_zero_user_backward.py::TestUnmanagedGradientAccumulation::test_unmanaged_matches_managed"
        # hpZ's secondary copy from initialize on, in eval and between accumulation steps (zpg 2 at
        # 4 ranks: the variant's node level); marked sequential, which DeepSpeed's pytest.ini deselects
        "unit/runtime/zero/test_zeropp.py::TestZeroPPConfigSweep::test_eval[2-9-1024]"
        "unit/runtime/zero/test_zeropp.py::TestZeroPPConfigSweep::test_gradient_accumulation[2-9-1024]"
        -m "not nightly"
    )
fi

export PATH="$root/.venv/bin:$PATH"
export TORCH_EXTENSIONS_DIR="$root/.venv/torch_extensions"
export PYTHONPATH="$root:$root/tests/deepspeed_contract${PYTHONPATH:+:$PYTHONPATH}"
# DeepSpeed's CPU accelerator counts NUMA nodes as devices and skips tests needing more: it reads
# LOCAL_SIZE first (as DeepSpeed's own CPU CI sets it).
export LOCAL_SIZE=${LOCAL_SIZE:-8}
export HZ_CONTRACT_CPU_FP16=${HZ_CONTRACT_CPU_FP16:-1}
# A test whose ranks wait on each other for this long ends the whole run (DeepSpeed's own rule).
export DS_UNITTEST_TIMEOUT=${DS_UNITTEST_TIMEOUT:-300}
export HZ_CONTRACT_LOG="$out/events.jsonl" HZ_CONTRACT_RESULTS="$out/results.jsonl"
status=0
(cd "$tests" && "$root/.venv/bin/python" -m pytest -p hz_contract -p no:cacheprovider -rA \
    "${selection[@]}") >"$out/pytest.log" 2>&1 || status=$?
"$root/.venv/bin/python" - "$out/results.jsonl" <<'EOF'
import collections, json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]


def kind(r: dict) -> str:
    """variant: built a hierarchical engine or partitioned under the variant's Init; refused: a
    start-up check of the variant refused the config; stock only: neither (no ZeRO-3 engine)."""
    if r["variant_engines"] or r["variant_inits"]:
        return "variant"
    return "refused" if r["refusals"] else "stock only"


counts = collections.Counter((r["outcome"], kind(r)) for r in rows)
for (outcome, engines), n in sorted(counts.items()):
    print(f"{outcome:8} {engines:10} {n}")
print(f"total    {len(rows)}")
for r in rows:
    if r["outcome"] == "failed":
        print(f"FAILED {r['test']}: {r['refusals'][0] if r['refusals'] else r['error']}")
EOF
echo "pytest exit status $status; per-test results in $out/results.jsonl, output in $out/pytest.log"
