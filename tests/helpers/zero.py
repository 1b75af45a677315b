"""The small hierarchical ZeRO-3 runs the engine tests share: an MLP (``tools.ab.model.mlp``, the
ZeRO benchmark's too), its DeepSpeed config, an engine of each kind (stock, hpZ, ours) and a training
loop that returns losses and parameters."""

from __future__ import annotations

import torch

from deepspeed_ext.zero.tools.ab import model
from deepspeed_ext.zero.tools.ab.engine import initialize
from mdsp_base import comm
from mdsp_base.topology import Topology

TOPOLOGY = Topology(world_size=8, ranks_per_node=4, ranks_per_package=2)
STEPS = 10
MICRO = 2
# The hops add the 8 ranks' fp32 gradients package, then node, then global, stock's ring in another
# order: per element and step a difference of a few fp32 ulps of the sum's magnitudes (<= 7 x 2^-24
# relative), which Adam's normalisation carries into the parameters and losses over STEPS steps.
TOL = dict(rtol=2e-5, atol=2e-6)
PERSISTENCE_THRESHOLD = 32  # the biases (29, 31 and 7 elements) persist, the weights do not


def ds_config(hierarchical: dict | None = None, micro: int = MICRO, **zero) -> dict:
    """Small fp32 ZeRO-3 config whose every step gathers every parameter (no reuse, no persistence)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": micro,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
            **zero,
        },
        "steps_per_print": 10**9,
        "topology": {"ranks_per_node": 4, "ranks_per_package": 2},
    }
    if hierarchical is not None:
        cfg["hierarchical_zero"] = {"enabled": True, **hierarchical}
    return cfg


def mlp() -> torch.nn.Module:
    """Odd sizes, so that every parameter is padded to the DP size."""
    return model.mlp((13, 29, 31, 7))


def mlp_numels() -> tuple[int, ...]:
    return tuple(p.numel() for p in mlp().parameters())


def batch(
    step: int, micro: int, dp_rank: int, width: int = 13, out: int = 7
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + dp_rank)
    return torch.randn(2, width, generator=g), torch.randn(2, out, generator=g)


def reset_deepspeed_globals() -> None:
    """DeepSpeed keeps the last engine's mpu, hpZ group and clone of the world group in module
    globals, which outlive the process groups of an earlier run in the same worker; start each
    engine clean."""
    from deepspeed.utils import groups

    groups.mpu = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups._WORLD_GROUP = None


def make_engine(kind: str, cfg: dict, model: torch.nn.Module, mpu=None, topology: Topology = TOPOLOGY):
    comm.patch_deepspeed_comm()
    return initialize(kind == "ours", model, cfg, topology, mpu)


def train(
    engine,
    steps: range,
    dp_rank: int,
    micro: int,
    topology: Topology = TOPOLOGY,
    width: int = 13,
    out: int = 7,
) -> tuple[list[float], list[dict]]:
    """Losses (mean over micro-batches) and bytes per step ({phase: {kind: {link: bytes}}})."""
    counter = comm.CommCounter(topology)
    losses, counts = [], []
    with comm.counting(counter):
        for step in steps:
            counter.reset()
            total = 0.0
            for m in range(micro):
                x, y = batch(step, m, dp_rank, width, out)
                with counter.phase("forward"):
                    out_ = engine(x)
                    loss = torch.nn.functional.mse_loss(out_[0] if isinstance(out_, tuple) else out_, y)
                with counter.phase("backward"):
                    engine.backward(loss)
                with counter.phase("step"):
                    engine.step()
                total += loss.item()
            losses.append(total / micro)
            counts.append(counter.snapshot())
    return losses, counts


def full_params(engine) -> list[torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]
