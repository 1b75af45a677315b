"""Full ZeRO++ (hpZ + qwZ + qgZ) on the CPU with the quantizer stand-ins, on 4 gloo ranks as 2 nodes
of 2: DeepSpeed's own qgZ all-to-all lands each rank's partition where reduce-scatter does (exactly,
on gradients the int4 codes hold without loss), and 20 steps of the engine tests' MLP stay within 3 %
of stock ZeRO-3's losses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.zero import quantizer_standin as q
from deepspeed_ext.zero.tools.ab.engine import release
from mdsp_base.installer import Installer
from mdsp_base.topology import Topology
from tests.helpers.zero import ds_config, make_engine, train

WORLD, PER_NODE = 4, 2
NODES = WORLD // PER_NODE
TWO_NODES = Topology(world_size=WORLD, ranks_per_node=PER_NODE, ranks_per_package=PER_NODE)
WIDTHS = (16, 64, 64, 32)  # every weight's and bias's partition a multiple of qwZ's 8-value groups
STEPS = 20
ZEROPP = {
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
    "zero_hpz_partition_size": PER_NODE,
}


def _exact_gradients(rank: int) -> torch.Tensor:
    """16 x 16 values k / 8, k even in [-8, 6], each 16-value group led by -8 on every rank: int4
    holds them exactly (scale 1/8, codes k), and the sum of a node's two ranks too (group absmax
    16 / 8, codes k1/2 + k2/2), so qgZ's result is exact and any misplaced partition shows."""
    g = torch.Generator().manual_seed(rank)
    k = 2 * torch.randint(-4, 4, (16, 16), generator=g)
    k[:, 0] = -8
    return k.to(torch.float32) / 8


def _qgz_against_the_dense_sum() -> dict:
    import deepspeed
    from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce
    from deepspeed.utils import groups

    rank = dist.get_rank()
    deepspeed.init_distributed(dist_backend="gloo")
    grad = _exact_gradients(rank)
    with Installer() as installer:
        q.install(installer, PER_NODE)
        (mine,) = all_to_all_quant_reduce([grad], groups._get_local_all_to_all_group())
    every = [torch.empty_like(grad) for _ in range(WORLD)]
    dist.all_gather(every, grad)
    dense = torch.stack(every).sum(0).reshape(WORLD, -1)[rank]
    return {"qgz": mine.to(torch.float32), "dense": dense}


def test_deepspeeds_qgz_all_to_all_gives_each_rank_its_partition(run_ranks):
    for r in run_ranks(WORLD, _qgz_against_the_dense_sum):
        # DeepSpeed's qgZ sums over every rank and divides by the nodes only (reduce-scatter divides
        # by the world): its result is the node's ranks times the mean
        assert torch.equal(r["qgz"], r["dense"] / NODES)


def _counted(name: str, calls: dict[str, int]) -> Callable[..., Any]:
    """The stand-in's ``name``, counting its calls in ``calls``."""
    op = getattr(q, name)

    def counted(*args: Any) -> Any:
        calls[name] += 1
        return op(*args)

    return counted


def _losses(zero: dict, rank: int) -> tuple[list[float], dict[str, int]]:
    """One engine's 20 steps, and how often ZeRO++'s stand-ins ran."""
    calls = {"quantize": 0, "swizzle_quant": 0}
    with Installer() as installer:
        q.install(installer, PER_NODE)
        for name in calls:
            installer.setattr("tests", f"{name} counted", q, name, _counted(name, calls))
        cfg = ds_config(**zero)
        cfg["topology"] = {"ranks_per_node": PER_NODE, "ranks_per_package": PER_NODE}
        from deepspeed_ext.zero.tools.ab import model

        engine = make_engine("stock", cfg, model.mlp(WIDTHS), topology=TWO_NODES)
        losses, _ = train(engine, range(STEPS), rank, 2, TWO_NODES, WIDTHS[0], WIDTHS[-1])
        release(engine)
    return losses, calls


def _zero3_and_zeropp() -> dict:
    rank = dist.get_rank()
    zero3, _ = _losses({}, rank)
    zeropp, calls = _losses(ZEROPP, rank)
    return {"zero3": zero3, "zeropp": zeropp, "calls": calls}


def test_zeropp_trains_beside_zero3_within_the_stated_bound(run_ranks):
    runs = run_ranks(WORLD, _zero3_and_zeropp, timeout=300)
    for r in runs:
        assert r["calls"]["quantize"] > 0 and r["calls"]["swizzle_quant"] > 0  # qwZ and qgZ both ran
        zero3, zeropp = torch.tensor(r["zero3"]), torch.tensor(r["zeropp"])
        gaps = (zeropp - zero3).abs() / zero3
        gap = gaps.max().item()
        print(f"ZeRO++ against ZeRO-3 over {STEPS} steps: largest relative loss gap {gap:.4f}")
        # Step 1 sees the int8 weights alone (no update yet): each weight within 1/127 of its
        # group's absmax (a whole step where clamped, half elsewhere); measured 1e-4 to 3e-4 on
        # the 4 ranks, bounded at 2e-3. Later steps add int4 gradients (steps of 1/8 of a group's
        # absmax) through Adam, whose normalised update flips for the small gradients: measured at
        # most 0.0104 over the 20 steps on any rank, bounded at 0.03. Gradients sent to the wrong
        # ranks (the swizzle left out) measured up to 0.116. Above 0 (quantization acted).
        assert 0 < gaps[0] <= 2e-3, gaps[0]
        assert gap <= 0.03, gaps.tolist()
