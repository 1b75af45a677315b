"""Upstream pretrain_gpt.py (Megatron-LM core_v0.16.1, Megatron-DeepSpeed 4efb479) trains on CPU
through ``python -m megatron_ext.launch`` at TP=2 x DP=2 (4 gloo ranks under torchrun), unpatched,
patched with the plugins off and with each plugin on; with dropout 0 every run must print the
unpatched run's ``lm loss`` at every iteration, and each plugin run must log its plugin enabled.

Trees and data: tests/upstream_setup.py (../shared/upstream/, a cache outside the project). Where
CI=true a missing prerequisite fails the tests; elsewhere it skips them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from upstream_setup import SetupError, Tree, prepare, tool_env

pytestmark = pytest.mark.upstream

ITERS = 4
RUN_TIMEOUT_S = 300
LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([0-9.E+-]+) \|")
PLUGIN_CONFIG = re.compile(r"plugin config: (\{.*\})")
COMMON = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "64", "--max-position-embeddings", "64", "--train-iters", str(ITERS), "--lr", "1e-3",
          "--min-lr", "1e-4", "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "256", "--split", "100,0,0", "--no-gradient-accumulation-fusion", "--num-workers", "0"]
# Megatron-LM without Apex or Transformer Engine: torch layers, no fused CUDA kernels; sequence
# parallelism through our sequence-parallel block (upstream's own local spec refuses it).
MEGATRON_LM = ["--sequence-parallel", "--micro-batch-size", "2", "--global-batch-size", "8",
               "--distributed-backend", "gloo", "--use-cpu-initialization", "--transformer-impl", "local",
               "--no-persist-layer-norm", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
               "--no-masked-softmax-fusion"]
LOCAL_SPEC = ["--spec", "megatron_ext.megatron_lm", "local_layer_spec"]
FLASH = ["--spec", "megatron_ext.megatron_lm", "flash_overlap_layer_spec", "--flash-overlap"]
# Megatron-DeepSpeed: ZeRO-3 needs --no-pipeline-parallel; its non-flash attention needs micro batch 1;
# its ZeRO-3 drops weight decay for parameters partitioned under zero.Init, which hierarchical ZeRO
# builds unpartitioned: weight decay 0 keeps the runs comparable.
DEEPSPEED = ["--micro-batch-size", "1", "--global-batch-size", "4", "--weight-decay", "0", "--deepspeed",
             "--zero-stage", "3", "--no-pipeline-parallel"]
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4, "gradient_accumulation_steps": 2,
             "zero_optimization": {"stage": 3}, "steps_per_print": 1000}

# (upstream, variant) -> (patched tree?, flags, plugins that must be logged enabled)
VARIANTS = {
    ("megatron-lm", "unpatched"): (False, LOCAL_SPEC, ()),
    ("megatron-lm", "patched-off"): (True, LOCAL_SPEC, ()),
    ("megatron-lm", "shm-data-loader"): (True, [*LOCAL_SPEC, "--shm-data-loader"], ("shm_data_loader",)),
    ("megatron-lm", "flash-overlap"): (True, FLASH, ("flash_overlap",)),
    ("megatron-lm", "both"): (True, [*FLASH, "--shm-data-loader"], ("flash_overlap", "shm_data_loader")),
    ("megatron-deepspeed", "unpatched"): (False, [], ()),
    ("megatron-deepspeed", "patched-off"): (True, [], ()),
    ("megatron-deepspeed", "shm-data-loader"): (True, ["--shm-data-loader"], ("shm_data_loader",)),
    ("megatron-deepspeed", "hierarchical-zero"): (True, ["--hierarchical-zero"], ("hierarchical_zero",)),
    ("megatron-deepspeed", "both"): (True, ["--shm-data-loader", "--hierarchical-zero"],
                                     ("shm_data_loader", "hierarchical_zero")),
}
_runs: dict[tuple[str, str], tuple[list[tuple[int, str]], str]] = {}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tree]:
    try:
        trees = prepare()
    except SetupError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"upstream training tests cannot run in CI: {exc}")
        pytest.skip(f"upstream training tests need: {exc}")
    trees["work"] = tmp_path_factory.mktemp("upstream-runs")  # type: ignore[assignment]
    return trees


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(tree: Tree, kind: str, patched: bool, flags: list[str], work: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "megatron_ext.launch",
           str((tree.patched if patched else tree.pristine) / "pretrain_gpt.py"), *COMMON,
           "--data-path", tree.data, "--data-cache-path", str(work / f"index-{kind}")]
    if kind == "megatron-lm":
        return cmd + MEGATRON_LM + flags
    config = work / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    return cmd + DEEPSPEED + ["--deepspeed_config", str(config)] + flags


def _train(upstream: dict, kind: str, variant: str) -> tuple[list[tuple[int, str]], str]:
    if (kind, variant) in _runs:
        return _runs[(kind, variant)]
    patched, flags, _ = VARIANTS[(kind, variant)]
    work, port = upstream["work"], _free_port()
    env = {**tool_env(), "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run(_command(upstream[kind], kind, patched, flags, work, port), cwd=work, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-4000:]
        pytest.fail(f"{kind} {variant} did not finish in {RUN_TIMEOUT_S}s; output ends:\n{out!r}")
    finally:
        # DeepSpeed's CPU all-reduce leaves a buffer per rank in /dev/shm, named after the port.
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{kind} {variant} exited {done.returncode}; output ends:\n{log[-6000:]}"
    losses = sorted({int(it): loss for it, total, loss in LOSS.findall(log)}.items())
    _runs[(kind, variant)] = (losses, log)
    return losses, log


@pytest.mark.parametrize("kind", ["megatron-lm", "megatron-deepspeed"])
def test_unpatched_upstream_trains_on_cpu(upstream: dict, kind: str) -> None:
    losses, log = _train(upstream, kind, "unpatched")
    assert [it for it, _ in losses] == list(range(1, ITERS + 1)), f"no lm loss for every iteration:\n{log[-4000:]}"
    assert float(losses[-1][1]) < float(losses[0][1]), f"loss did not fall: {losses}"


@pytest.mark.parametrize(("kind", "variant"), [key for key in VARIANTS if key[1] != "unpatched"])
def test_upstream_with_plugins_prints_the_baseline_losses(upstream: dict, kind: str, variant: str) -> None:
    baseline, _ = _train(upstream, kind, "unpatched")
    losses, log = _train(upstream, kind, variant)
    configs = [json.loads(m) for m in PLUGIN_CONFIG.findall(log)]
    if variant != "patched-off":
        assert configs, f"{kind} {variant}: no 'plugin config:' line logged"
    for config in configs:
        for plugin in ("shm_data_loader", "hierarchical_zero", "flash_overlap"):
            assert config[plugin]["enabled"] == (plugin in VARIANTS[(kind, variant)][2]), (plugin, config)
    assert len(baseline) == ITERS and losses == baseline, f"{kind} {variant}: {losses} != unpatched {baseline}"
