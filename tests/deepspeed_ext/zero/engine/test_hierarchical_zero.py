"""Hierarchical ZeRO-3 against stock DeepSpeed ZeRO-3 and ZeRO++ hpZ at 8 ranks (2 nodes x 2 packages x 2).

One pool call trains every variant (engines are the expensive part); the assertions then compare
losses and parameters with stock ZeRO-3, measured bytes with the cost model, and checkpoint resume
with an uninterrupted run. The resumed engine keeps its biases gathered (persistent parameters), so
the gathers DeepSpeed makes of those after each step are checked to run in hops too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost import volume as cm
from mdsp_base import comm
from mdsp_base.volume import LINK_CLASSES
from tests.helpers.zero import (
    MICRO,
    PERSISTENCE_THRESHOLD,
    STEPS,
    TOL,
    TOPOLOGY,
    ds_config,
    full_params,
    make_engine,
    mlp,
    mlp_numels,
    reset_deepspeed_globals,
    train,
)


def _built_under_init(cfg: dict):
    """The hierarchical engine of a model built partitioned under our zero.Init, with the same plan."""
    from deepspeed_ext import zero

    reset_deepspeed_globals()
    comm.patch_deepspeed_comm()
    plan = zero.prepare(cm.ShardSpec(mlp_numels(), weight_bytes=4, grad_bytes=4), cfg, topology=TOPOLOGY)
    with zero.Init(plan.levels, config_dict_or_path=cfg):
        net = mlp()
    engine, *_ = zero.initialize(
        model=net, config=cfg, topology=TOPOLOGY, plan=plan, model_parameters=net.parameters()
    )
    reset_deepspeed_globals()
    return engine


def _variants(ckpt_dir: str) -> dict:
    """Every run of the 8-rank comparison, on each rank. The package run saves a checkpoint after
    step 5 and goes on; a fresh engine then loads it and redoes steps 5-9 (the resumed run)."""
    rank = dist.get_rank()
    runs = {}
    for name, kind, cfg in (
        ("zero3", "stock", ds_config()),
        ("hpz", "stock", ds_config(zero_hpz_partition_size=4)),
        ("package", "ours", ds_config({"secondary_level": "auto"})),
        ("boundary", "ours", ds_config({"secondary_level": "package", "grad_sync": "accumulation_boundary"})),
        ("node", "init", ds_config({"secondary_level": "node"})),
    ):
        engine = _built_under_init(cfg) if kind == "init" else make_engine(kind, cfg, mlp())
        losses, counts = train(engine, range(5), rank, MICRO)
        if name == "package":
            engine.save_checkpoint(ckpt_dir, tag="mid")
        more, more_counts = train(engine, range(5, STEPS), rank, MICRO)
        level = engine.hierarchical_zero.levels.secondary_level if kind != "stock" else None
        counter = comm.CommCounter(TOPOLOGY)
        with comm.counting(counter):
            params = full_params(engine)
        runs[name] = {
            "losses": losses + more,
            "counts": counts + more_counts,
            "params": params,
            "level": level,
            "gathered_parameters": counter.per_link(kind="gather"),
        }
        engine.destroy()
    cfg = ds_config({"secondary_level": "auto"}, stage3_param_persistence_threshold=PERSISTENCE_THRESHOLD)
    engine = make_engine("ours", cfg, mlp())
    engine.load_checkpoint(ckpt_dir, tag="mid")
    losses, counts = train(engine, range(5, STEPS), rank, MICRO)
    runs["resumed"] = {
        "losses": runs["package"]["losses"][:5] + losses,
        "params": full_params(engine),
        "counts": counts,
        "persistent": sorted(p.ds_numel for p in engine.optimizer.persistent_parameters),
    }
    engine.destroy()
    return runs


@pytest.fixture(scope="module")
def runs(run_ranks, tmp_path_factory):
    return run_ranks(8, _variants, str(tmp_path_factory.mktemp("ckpt")), timeout=600)


def test_losses_and_parameters_equal_stock_zero3(runs):
    for rank_runs in runs:
        ref = rank_runs["zero3"]
        for name in ("hpz", "package", "boundary", "node", "resumed"):
            torch.testing.assert_close(
                torch.tensor(rank_runs[name]["losses"]), torch.tensor(ref["losses"]), **TOL
            )
            for got, want in zip(rank_runs[name]["params"], ref["params"]):
                torch.testing.assert_close(got, want, **TOL)
    assert len(runs[0]["zero3"]["losses"]) >= 10


def test_auto_picks_package_and_checkpoint_resume_matches(runs):
    assert runs[0]["package"]["level"] == "package"
    assert runs[0]["node"]["level"] == "node"
    for rank_runs in runs:
        assert rank_runs["resumed"]["losses"] == pytest.approx(
            rank_runs["package"]["losses"], rel=1e-6, abs=1e-7
        )


def expected_bytes(name: str) -> dict[tuple[str, str], dict[str, int]]:
    """Bytes one rank sends per steady step (2 micro-batches), derived by hand. M: the fp32 model
    padded to the 8 DP ranks. A collective over g ranks sends (g-1)/g of its buffer; hops gather
    outermost first (M/4 across the 2 nodes, M/2 across the 2 packages, M in the package) and
    reduce innermost first; hpZ(4) and our node level hold the secondary copy per node, our package
    level per package. The first forward of a step gathers the primary partition, the second and
    every backward the secondary copy."""
    m = 4 * sum(-(-n // 8) * 8 for n in mlp_numels())
    flat = 7 * m // 8  # one collective over all 8 ranks
    primary = {"package": m // 2, "node": m // 4, "inter_node": m // 8}  # in hops
    package_copy = {"package": m // 2, "node": 0, "inter_node": 0}
    node_copy = {"package": m // 2, "node": m // 4, "inter_node": 0}

    def plus(*parts: dict[str, int]) -> dict[str, int]:
        return {link: sum(p.get(link, 0) for p in parts) for link in ("package", "node", "inter_node")}

    twice_flat = plus({"inter_node": flat}, {"inter_node": flat})
    hops_reduce = plus(primary, primary)
    table = {
        "zero3": {
            ("forward", "gather"): twice_flat,
            ("backward", "gather"): twice_flat,
            ("backward", "reduce"): twice_flat,
        },
        "hpz": {
            ("forward", "gather"): plus({"inter_node": flat}, {"node": 3 * m // 4}),
            ("backward", "gather"): plus({"node": 3 * m // 4}, {"node": 3 * m // 4}),
            ("backward", "reduce"): twice_flat,
        },
        "package": {
            ("forward", "gather"): plus(primary, package_copy),
            ("backward", "gather"): plus(package_copy, package_copy),
            ("backward", "reduce"): hops_reduce,
        },
        "boundary": {
            ("forward", "gather"): plus(primary, package_copy),
            ("backward", "gather"): plus(package_copy, package_copy),
            ("backward", "reduce"): plus(hops_reduce, {"inter_node": -(m // 8)}),  # across nodes once
        },
        "node": {
            ("forward", "gather"): plus(primary, node_copy),
            ("backward", "gather"): plus(node_copy, node_copy),
            ("backward", "reduce"): hops_reduce,
        },
    }
    return table[name]


@pytest.mark.parametrize("name", ["zero3", "hpz", "package", "boundary", "node"])
def test_bytes_per_link_class_are_the_hand_derived_ones(runs, name):
    for rank_runs in runs:
        steady = rank_runs[name]["counts"][1:]  # step 0, DeepSpeed's first, differs for stock ZeRO-3 too
        assert all(c == steady[0] for c in steady)
        for (phase, kind), want in expected_bytes(name).items():
            measured = steady[0].get(phase, {}).get(kind, dict.fromkeys(LINK_CLASSES, 0))
            assert measured == want, (name, phase, kind)
        assert "gather" not in steady[0].get("step", {}) and "reduce" not in steady[0].get("step", {})


def test_backward_gathers_stay_in_node_and_inter_node_bytes_at_most_hpz(runs):
    for rank_runs in runs:
        for name in ("package", "node"):
            step = rank_runs[name]["counts"][-1]
            assert step["backward"]["gather"]["inter_node"] == 0
            ours = sum(
                kinds.get(k, {}).get("inter_node", 0) for kinds in step.values() for k in ("gather", "reduce")
            )
            hpz_step = rank_runs["hpz"]["counts"][-1]
            theirs = sum(
                kinds.get(k, {}).get("inter_node", 0)
                for kinds in hpz_step.values()
                for k in ("gather", "reduce")
            )
            assert 0 < ours <= theirs, (name, ours, theirs)


def test_gradients_cross_nodes_once_per_step_with_boundary_sync(runs):
    for rank_runs in runs:
        every = rank_runs["package"]["counts"][-1]["backward"]["reduce"]
        once = rank_runs["boundary"]["counts"][-1]["backward"]["reduce"]
        assert once["inter_node"] * MICRO == every["inter_node"] > 0
        assert (once["package"], once["node"]) == (every["package"], every["node"])


def test_gathered_parameters_run_in_hops_not_one_flat_collective(runs):
    """What a flat all-gather over the 8 DP ranks would send (all of it charged to inter_node)
    against what GatheredParameters sends per link class: the cross-node hop gathers a quarter of
    the model over 2 nodes, 1/8 of it per rank where the flat collective charges 7/8."""
    flat = 4 * sum(-(-n // 8) * 8 for n in mlp_numels()) * 7 // 8  # fp32, padded to the DP size
    for rank_runs in runs:
        for name in ("package", "node"):
            sent = rank_runs[name]["gathered_parameters"]
            assert sent["package"] > 0 and sent["node"] > 0, (name, sent)
            assert sent["inter_node"] == pytest.approx(flat / 7, rel=0.02), (name, sent, flat)
        assert rank_runs["zero3"]["gathered_parameters"]["inter_node"] == pytest.approx(flat, rel=0.01)


def test_persistent_parameters_are_gathered_in_hops(runs):
    """The resumed run keeps its biases gathered: after each optimizer step DeepSpeed gathers them
    again (through ``deepspeed.comm.all_gather_into_tensor`` on our group), and that gather runs in
    hops: per rank, a partition of ``b`` bytes crosses nodes once (``b``), then ``2b`` inside the
    node and ``4b`` inside the package, where a flat gather would charge ``7b`` to inter_node. The
    forward passes no longer gather them. Its losses equal stock ZeRO-3's
    (test_losses_and_parameters_equal_stock_zero3)."""
    persistent = tuple(n for n in mlp_numels() if n <= PERSISTENCE_THRESHOLD)
    b = 4 * sum(-(-n // 8) for n in persistent)  # fp32 partition of each, padded to the DP size
    for rank_runs in runs:
        assert rank_runs["resumed"]["persistent"] == sorted(persistent)
        for step in rank_runs["resumed"]["counts"]:
            assert step["step"]["gather"] == {"package": 4 * b, "node": 2 * b, "inter_node": b}
        forward = rank_runs["resumed"]["counts"][-1]["forward"]["gather"]
        gathered_always = rank_runs["package"]["counts"][-1]["forward"]["gather"]
        # the first forward of a step gathers over nodes (later ones use the secondary copy): b less
        assert gathered_always["inter_node"] - forward["inter_node"] == b


def test_pack_writes_hop_order_with_an_index_made_once_per_plan():
    """pack equals the flat chunking put in hop order, its row index is kept on the plan (made once
    per device) and the cache leaves plan equality and hashing alone."""
    from deepspeed_ext.zero.engine import hops
    from deepspeed_ext.zero.engine.levels import HopSchedule
    from mdsp_base.topology import LinkClass

    g = torch.Generator().manual_seed(3)
    for sizes in ((2, 2, 2), (1, 2, 2), (2, 3, 4), (3, 1, 5), (4,)):
        plan = HopSchedule(tuple(range(24)), sizes, (None,) * len(sizes), (LinkClass.PACKAGE,) * len(sizes))
        p = math.prod(sizes)
        tensors = [torch.randn(n, generator=g, dtype=torch.float64) for n in (7, 1, 0, 2 * p, 3 * p - 1)]
        chunks = [-(-t.numel() // p) for t in tensors]
        flat = torch.cat(
            [torch.nn.functional.pad(t, (0, p * c - t.numel())).view(p, c) for t, c in zip(tensors, chunks)],
            1,
        )
        got, got_chunks = hops.pack(tensors, plan)
        assert got_chunks == chunks and got.shape[0] == 1  # one piece: the whole buffer
        rows = hops.hop_order(plan, (flat / p).reshape(-1)).view(p, -1)
        torch.testing.assert_close(got[0], rows.reshape(-1), rtol=0, atol=0)
        pieces, _ = hops.pack(tensors, plan, pieces=3)  # each piece: a third of every row, contiguous
        width = -(-rows.shape[1] // 3)
        padded = torch.nn.functional.pad(rows, (0, 3 * width - rows.shape[1]))
        for k in range(3):
            torch.testing.assert_close(
                pieces[k], padded[:, k * width : (k + 1) * width].reshape(-1), rtol=0, atol=0
            )
        index, ints = hops.hop_rows(plan, torch.device("cpu"))
        assert hops.hop_rows(plan, torch.device("cpu"))[0] is index and list(plan.row_cache) == [
            torch.device("cpu")
        ]
        assert index.tolist() == list(ints) and sorted(ints) == list(range(p))
        twin = HopSchedule(plan.parent, plan.sizes, plan.groups, plan.links)
        assert twin == plan and hash(twin) == hash(plan) and not twin.row_cache
