"""The main job on one GPU as a user runs it: TP=1, bf16, NCCL, no CPU support. With every plugin
that applies to one rank (the node loader copying through pinned memory, hierarchical ZeRO-3, the
Flash-Overlap layers) the loss falls and equals the run without plugins."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "256",
    "--micro-batch-size",
    "4",
    "--train-iters",
    "30",
    "--lr",
    "1e-3",
    "--bf16",
]


def _config(tmp_path, plugins: bool) -> str:
    config = {
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"torch_adam": True}},
    }
    for section in ("shm_data_loader", "hierarchical_zero", "flash_overlap"):
        config[section] = {"enabled": plugins}
    path = tmp_path / f"ds-{plugins}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _run(tmp_path, plugins: bool) -> tuple[str, dict[int, float]]:
    log = tmp_path / f"log-{plugins}.jsonl"
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "pretrain_gpt.py"),
            *MODEL,
            "--deepspeed-config",
            _config(tmp_path, plugins),
            "--data-cache-path",
            str(tmp_path / "data"),
            "--log-json",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout, {r["iteration"]: r["loss"] for r in map(json.loads, open(log))}


def test_plugins_on_one_gpu_train_to_the_same_losses(tmp_path):
    stock_out, stock = _run(tmp_path, plugins=False)
    ours_out, ours = _run(tmp_path, plugins=True)
    for out in (stock_out, ours_out):
        assert "device cuda:0, backend nccl, megatron-core CPU support off" in out, out[-2000:]
    print(json.dumps({"stock": stock, "plugins": ours}))
    assert sorted(ours) == sorted(stock) == list(range(1, 31))
    assert stock[30] < stock[1] - 1.0, stock
    assert ours == stock
