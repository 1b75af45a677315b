"""Byte counting per link class, and hop collectives equal to the flat ones, at 8 ranks (2 x 2 x 2)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from mdsp_base import comm
from mdsp_base.topology import Topology
from mdsp_base.volume import span_class, volume

TOPOLOGY = Topology(world_size=8, ranks_per_node=4, ranks_per_package=2)


def _flat_vs_hops() -> dict:
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced as ds_rs

    from deepspeed_ext.zero.config import HierarchicalZeroConfig
    from deepspeed_ext.zero.engine import hops
    from deepspeed_ext.zero.engine.levels import build_levels

    comm.patch_deepspeed_comm()  # also brings up DeepSpeed's communication backend
    rank = dist.get_rank()
    out, package = {}, None
    for name, parents in (("tp1", [list(range(8))]), ("tp2", [[0, 2, 4, 6], [1, 3, 5, 7]])):
        dp = None
        for parent in parents:  # every rank creates every group, in the same order
            made = dist.new_group(parent)
            dp = made if rank in parent else dp
        levels = build_levels(TOPOLOGY, dp, "node", HierarchicalZeroConfig())
        package = package or levels.groups.groups["package"]  # TP=1: two ranks per package
        plan, p = levels.dp_plan(), len(levels.dp_ranks)
        g = torch.Generator().manual_seed(rank)
        data = torch.randn(p * 6, generator=g, dtype=torch.float64)
        flat = torch.empty(6, dtype=torch.float64)
        comm.reduce_scatter_tensor(flat, data.clone(), group=dp)
        block = torch.randn(5, generator=g, dtype=torch.float64)
        gathered, gathered_hops = (
            torch.empty(p * 5, dtype=torch.float64),
            torch.empty(p * 5, dtype=torch.float64),
        )
        comm.all_gather_into_tensor(gathered, block, group=dp)
        hops.all_gather(plan, block, gathered_hops)
        tensors = [torch.randn(n, generator=g, dtype=torch.float64) for n in (7, 1, 16, 3)]
        out[name] = {
            "reduce_scatter": torch.allclose(hops.reduce_scatter(plan, data), flat, rtol=1e-12, atol=1e-12),
            "all_gather": torch.equal(gathered_hops, gathered),
            "coalesced": all(
                torch.allclose(a, b, rtol=1e-12, atol=1e-12)
                for a, b in zip(
                    hops.reduce_scatter_coalesced(plan, [t.clone() for t in tensors]),
                    ds_rs([t.clone() for t in tensors], dp),
                )
            ),
            "sizes": plan.sizes,
        }

    counter = comm.CommCounter(TOPOLOGY)
    with warnings.catch_warnings(record=True) as caught, comm.counting(counter):
        warnings.simplefilter("always")
        with counter.phase("ours"):
            comm.all_gather_into_tensor(torch.empty(8 * 4), torch.ones(4))
            comm.reduce_scatter_tensor(torch.empty(3), torch.ones(6), group=package)
        with counter.phase("deepspeed"):
            ds_dist.allgather_fn(torch.empty(8 * 4), torch.ones(4))
            ds_dist.reduce_scatter_fn(torch.empty(8), torch.ones(8 * 4), group=dp)
            ds_dist.all_reduce(torch.ones(10))
    out["counts"] = counter.snapshot()
    out["future_warnings"] = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return out


def test_hops_equal_flat_collectives_and_bytes_are_counted_per_link(run_ranks):
    results = run_ranks(8, _flat_vs_hops)
    for r in results:
        assert r["tp1"]["sizes"] == (2, 2, 2) and r["tp2"]["sizes"] == (1, 2, 2)
        for name in ("tp1", "tp2"):
            assert r[name]["reduce_scatter"] and r[name]["all_gather"] and r[name]["coalesced"], (
                name,
                r[name],
            )
        assert r["future_warnings"] == []
        counts = r["counts"]
        # all-gather of 32 floats over 8 ranks spanning nodes: 7/8 of 128 bytes; reduce-scatter in a package: half of 24.
        assert counts["ours"]["gather"] == {"package": 0, "node": 0, "inter_node": 112}
        assert counts["ours"]["reduce"] == {"package": 12, "node": 0, "inter_node": 0}
        assert counts["deepspeed"]["gather"]["inter_node"] == 112
        # reduce-scatter over the TP=2 DP group (4 ranks over 2 nodes): 3/4 of 128 bytes.
        assert counts["deepspeed"]["reduce"]["inter_node"] == 96
        assert counts["deepspeed"]["other"]["inter_node"] == 2 * 40 * 7 // 8


def test_link_class_and_volume_arithmetic():
    assert span_class(TOPOLOGY, [0, 1]) == "package"
    assert span_class(TOPOLOGY, [0, 2]) == "node"
    assert span_class(TOPOLOGY, [3, 4]) == "inter_node"
    assert volume("all_gather", 800, 8) == 700
    assert volume("all_reduce", 800, 8) == 1400
    assert volume("reduce_scatter", 800, 1) == 0
