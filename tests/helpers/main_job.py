"""The main job's small model as flags (its dropout is 0: runs are deterministic), shared by the
tests that launch ``scripts/pretrain_gpt.py``."""

SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--lr",
    "3e-3",
]
