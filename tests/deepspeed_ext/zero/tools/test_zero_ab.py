"""The A/B command a user runs before switching to hierarchical ZeRO: what it builds (stock ZeRO-3,
DeepSpeed's hpZ at its valid sizes, ZeRO++ where its kernels build, ours with the probe's profile),
how it counts, and that it runs end to end on the emulated cluster and from the Slurm scripts."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from deepspeed_ext.zero.cost.workload import Model
from deepspeed_ext.zero.tools.ab.cli import model_shape, parse_args
from deepspeed_ext.zero.tools.ab.model import build_model, flops_per_step
from deepspeed_ext.zero.tools.ab.report import comparison, prediction_error
from deepspeed_ext.zero.tools.ab.variants import Variant, ds_config, variants
from mdsp_base.topology import Topology
from tests.helpers.ab_quick import HAVE_NETNS

ROOT = Path(__file__).resolve().parents[4]


def test_hpz_runs_at_each_valid_size_and_zeropp_says_why_it_cannot_run_on_cpu():
    frontier = variants(Topology(world_size=16, ranks_per_node=8, ranks_per_package=2), torch.device("cpu"))
    assert [v.name for v in frontier] == ["zero3", "hpZ(2)", "hpZ(8)", "zero++ (hpZ + qwZ + qgZ)", "ours"]
    assert frontier[2].zero == {"zero_hpz_partition_size": 8}
    zeropp = frontier[3]
    assert zeropp.zero["zero_hpz_partition_size"] == 8 and zeropp.zero["zero_quantized_weights"]
    assert "CUDA kernels" in zeropp.skipped and "cpu" in zeropp.skipped
    one_node = variants(Topology(world_size=8, ranks_per_node=8, ranks_per_package=1), torch.device("cpu"))
    assert [v.skipped is None for v in one_node] == [True, False, False, True]
    assert "more than one node" in one_node[2].skipped


def test_each_variant_runs_the_users_json_as_zero3_with_only_its_own_keys():
    user = {
        "train_batch_size": 64,
        "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 123},
        "hierarchical_zero": {"enabled": True, "secondary_level": "node"},
    }
    stock = ds_config(user, Variant("hpZ(8)", ours=False, zero={"zero_hpz_partition_size": 8}), "p.json")
    assert stock["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 123, "zero_hpz_partition_size": 8}
    assert stock["hierarchical_zero"] == {"enabled": False, "secondary_level": "node"}
    assert "train_batch_size" not in stock and stock["gradient_accumulation_steps"] == 4
    ours = ds_config(user, Variant("ours", ours=True), "p.json")
    assert ours["hierarchical_zero"] == {"enabled": True, "secondary_level": "node", "profile": "p.json"}
    assert user["zero_optimization"]["stage"] == 1  # the user's dict is left as it was


def test_the_model_takes_a_megatron_presets_shape_and_counts_its_flops_by_hand():
    preset = ["--megatron-args", str(ROOT / "scripts/presets/gpt-1.3b.args")]
    assert model_shape(parse_args(preset)) == Model(layers=24, hidden=2048, heads=16, seq=2048, vocab=50304)
    assert model_shape(parse_args([*preset, "--seq-length", "64"])).seq == 64
    small = Model(layers=2, hidden=8, heads=2, seq=4, vocab=16)
    params = sum(p.numel() for p in build_model(small).parameters())
    # per layer 12 h^2 weights, 9 h biases and two norms (4 h); embedding and head V h each; final norm 2 h
    assert params == 2 * (12 * 64 + 13 * 8) + 2 * 16 * 8 + 2 * 8
    # 6 x (2 x 12 x 64 + 8 x 16) x 10 tokens + 12 x 2 x 8 x 4 x 10 tokens
    assert flops_per_step(small, 10) == pytest.approx(6 * (2 * 768 + 128) * 10 + 12 * 2 * 8 * 4 * 10)
    with pytest.raises(ValueError, match="hidden divisible by heads"):
        Model(layers=2, hidden=10, heads=4, seq=4)


def test_a_ratio_is_claimed_only_where_its_paired_interval_excludes_one():
    # steps from alternating rounds: round i of each variant forms a pair
    rows = [
        {"variant": "zero3", "ran": True, "step_s": [2.0, 2.2, 2.1, 2.0]},
        {"variant": "hpZ(2)", "ran": True, "step_s": [1.0, 2.6, 1.3, 2.4]},
        {"variant": "zero++", "ran": False, "reason": "cpu"},
        {"variant": "ours", "ran": True, "step_s": [1.0, 1.1, 1.05, 1.0]},
    ]
    lines = comparison(rows)
    # ours / zero3 is exactly 0.5 in every round: no spread, the interval is the point
    assert "ours against zero3: step 0.500x [0.500, 0.500]" in lines
    # hpZ(2)'s rounds scatter from 0.5x to 1.2x: its interval holds 1
    assert [line for line in lines if line.startswith("hpZ(2) against zero3")][0].endswith("not separated")
    assert [line for line in lines if line.startswith("ours against hpZ(2)")][0].endswith("not separated")
    assert not any("zero++" in line for line in lines)


def test_the_gather_wait_timer_wraps_deepspeeds_fetch_only_while_entered():
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    from deepspeed_ext.zero.tools.ab.gather_wait import GatherWait

    original = PartitionedParameterCoordinator.fetch_sub_module
    with GatherWait() as waited:
        assert PartitionedParameterCoordinator.fetch_sub_module is not original
        with pytest.raises(RuntimeError, match="already timing"):
            GatherWait().__enter__()
    assert PartitionedParameterCoordinator.fetch_sub_module is original
    assert (waited.seconds, waited.fetches) == (0.0, 0)


@pytest.mark.parametrize("platform", ["frontier", "nvidia"])
def test_the_slurm_scripts_run_the_probe_then_the_ab_command_with_its_profile(platform, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(JOB="zero-ab", DRY_RUN="1", NODES="2", AB_DIR=str(tmp_path))
    done = subprocess.run(
        ["bash", f"scripts/slurm/{platform}.sbatch", "--steps", "10"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    probe = lines[lines.index("# command 1: the probe") + 1]
    ab = lines[lines.index("# command") + 1]
    assert (
        probe.startswith("srun -N2") and f"-m deepspeed_ext.zero.probe --out {tmp_path}/profile.json" in probe
    )
    assert "-m deepspeed_ext.zero.bench" in ab and f"--profile {tmp_path}/profile.json" in ab
    assert ab.endswith("--steps 10") and "--megatron-args" in ab and "--deepspeed-config" in ab
    env["JOB"] = "zero-b"
    bad = subprocess.run(
        ["bash", f"scripts/slurm/{platform}.sbatch"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode != 0 and "use train (the default) or zero-ab" in bad.stderr


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root, ip and tc")
def test_probe_and_ab_quick_on_the_emulated_cluster(ab_quick):
    # python -m benchmarks.zero.ab --device mi250x --quick --warm --nodes 2, run in the background
    # from the session's start (tests/helpers/ab_quick.py): the frontier regime, the default, 2 nodes
    # of 2 MI250Xs (a NIC each, shared by its 2 GCDs), compute on the stand-in; the ranks forked warm
    out = ab_quick.out
    result = json.loads((out / "ab_frontier_mi250x_nodes2_quick.json").read_text())
    assert result["regime"] == "frontier" and result["spec"]["name"] == "frontier_bandwidth"
    assert result["spec"]["nodes"] == 2 and result["spec"]["packages_per_node"] == 2
    assert result["command"].endswith("--device mi250x --quick --warm")
    assert result["device"] == "mi250x" and result["dilation"] == 200_000 / result["spec"]["inter_node_mbit"]
    assert result["compute_only_step_s"] > 0
    assert [result["spec"][f"{link}_latency_ms"] for link in ("package", "node", "inter_node")] == [0, 0, 0]
    rows = {row["variant"]: row for row in result["variants"]}
    zeropp, quantized = "zero++ (hpZ + qwZ + qgZ)", "ours, quantized hops"
    ran = ("zero3", "hpZ(2)", "hpZ(4)", zeropp, "ours", quantized)
    # full ZeRO++ runs on the stand-in, its quantizer kernels each charged as one kernel
    assert list(rows) == list(ran) and all(rows[name]["ran"] for name in ran)
    for name in ran:
        row = rows[name]
        assert len(row["step_s"]) == 5 and min(row["step_s"]) > 0 and min(row["tflops"]) > 0
        # a flat ring over 8 ranks crosses every NIC; so do ours' cross-node hops
        assert row["nic_mib_per_step"] > 0 and row["package_link_mib_per_step"] >= 0
        assert row["peak_bytes"] is None  # an emulated device holds no tensors to count
        # predicted from the profile, the launches counted and the compute-only step. The 25 %
        # target is the benchmark's; this bound, 10x either way, catches a broken model's units.
        parts = row["predicted"]
        assert row["predicted_step_s"] == pytest.approx(
            parts["compute_s"] + parts["host_s"] + parts["comm_s"] - parts["hidden_s"]
        )
        assert parts["compute_s"] > 0 and parts["comm_s"] > 0 and row["calls_per_step"]
        assert -0.9 <= prediction_error(row) <= 9.0, (name, row["predicted_step_s"], row["step_s"])
        assert row["gather_wait_s"] > 0 and 0 < row["gather_wait_share"] < 1
        numbers = result["dimensionless"][name]
        assert numbers["links"]["inter_node"]["message_over_product"] > 0 and numbers["comm_over_compute"] > 0
    # every variant against stock ZeRO-3, each of ours against every DeepSpeed variant, from the 5
    # alternating rounds
    pairs = {(p["variant"], p["baseline"]): p for p in result["paired"]}
    expected = {(n, "zero3") for n in ran if n != "zero3"}
    expected |= {(o, n) for o in ("ours", quantized) for n in ("hpZ(2)", "hpZ(4)", zeropp)}
    assert set(pairs) == expected
    for p in pairs.values():
        assert p["metric"] == "step" and p["ci95"][0] <= p["ratio"] <= p["ci95"][1]
    assert result["auto_check"] and len(result["probe_s"]) == 2
    # one traced step per variant after the paired ones: its sums, and a Chrome trace of every rank
    assert set(result["trace"]) == set(ran) and result["trace_table"].count("\n") == 2 + len(ran)
    for name in ran:
        traced = result["trace"][name]
        assert traced["step_s"] > 0 and 0 < traced["device_busy_s"] <= traced["step_s"]
        assert traced["gather_wait_s"] == pytest.approx(sum(traced["gather_wait_by_level"].values()))
        assert traced["gather_busy_by_level"]["inter_node"] > 0  # every variant gathers across nodes
        chrome = json.loads(gzip.decompress(Path(rows[name]["trace_file"]).read_bytes()))
        slices = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in slices} == set(range(8))
        assert {"step", "fetch", "device", "gather", "reduce hook"} <= {e["cat"] for e in slices}
    assert result["trace"]["ours"]["hop_queue_s"] > 0 and result["trace"]["ours"]["copy_s"] > 0
    assert rows[quantized]["nic_mib_per_step"] < rows["ours"]["nic_mib_per_step"]  # int8 / int4 across nodes
    assert result["trace"]["zero3"]["hop_queue_s"] == 0  # stock ZeRO-3 has no hops
    assert (out / "ab_frontier_mi250x_nodes2_quick.png").stat().st_size > 0
    assert (out / "ab_frontier_mi250x_nodes2_quick_profile.json").exists()


@pytest.mark.netns
@pytest.mark.skipif(not HAVE_NETNS, reason="needs root, ip and tc")
def test_the_compute_only_step_does_not_grow_with_the_ranks(compute_only_quick):
    # python -m benchmarks.zero.compute_only --device mi250x --quick --warm --nodes 2 4: 8 and 16
    # ranks on 2 cores, every rank's model stepped alone at once on its virtual device
    result = json.loads((compute_only_quick.out / "compute_only_mi250x_quick.json").read_text())
    assert [size["ranks"] for size in result["sizes"]] == [8, 16]
    medians = [size["median_s"] for size in result["sizes"]]
    assert (max(medians) - min(medians)) / min(medians) <= 0.05, medians


def test_the_compute_only_step_trains_in_the_jobs_dtype():
    from deepspeed_ext.zero.tools.ab.prediction import job_dtype

    assert job_dtype({"bf16": {"enabled": True}}) is torch.bfloat16
    assert job_dtype({"fp16": {"enabled": True}}) is torch.float16
    assert job_dtype({"bf16": {"enabled": False}}) is torch.float32 and job_dtype({}) is torch.float32
