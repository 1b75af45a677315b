"""Where stock DeepSpeed ZeRO-3 accepts a call sequence, the hierarchical variant accepts it too, at
8 ranks (2 nodes x 2 packages x 2), and ends where stock ZeRO-3 ends; where it refuses, the error
names the real cause.

The sequence is the one of DeepSpeed's ``TestZeROSaveLoadEdgeCase::test_load_immediate_save``,
extended: train, save, build a fresh engine on the SAME module (DeepSpeed leaves its parameters
partitioned), load, save at once, destroy the first engine, train on. Stock DeepSpeed ZeRO-3 runs
the same sequence as the reference. A write to the primary partition right after ``initialize`` is
seen at once, as by stock ZeRO-3 (stock hpZ, which does not, is shown alongside).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from test_hierarchical_zero import TOL, TOPOLOGY, ds_config, full_params, make_engine, mlp, train

MICRO = 2


def _second_engine_on_the_same_module(kind: str, ckpt_dir: str) -> dict:
    rank = dist.get_rank()
    cfg = ds_config({"secondary_level": "package"} if kind == "ours" else None, micro=MICRO)
    model = mlp()
    first = make_engine(kind, cfg, model)
    losses, _ = train(first, range(2), rank, MICRO)
    first.empty_partition_cache()
    first.save_checkpoint(ckpt_dir, tag="trained")
    second = make_engine(kind, cfg, model)
    second.load_checkpoint(ckpt_dir, tag="trained")
    second.save_checkpoint(ckpt_dir, tag="saved_at_once")
    first.destroy()  # the second engine runs on: its groups must outlive the first engine
    more, _ = train(second, range(2, 4), rank, MICRO)
    result = {
        "losses": losses + more,
        "params": full_params(second),
        "same_plan": kind == "ours" and second.hierarchical_zero is first.hierarchical_zero,
        "saved": sorted(os.listdir(ckpt_dir)),
    }
    second.destroy()
    if kind == "ours":  # the groups the parameters are partitioned over are gone now
        result["after_destroy"] = _refusal(lambda: make_engine("ours", cfg, model))
    return result


def _refusal(build) -> str:
    from plugin_base.section import ConfigError

    try:
        build()
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def _foreign_partitions() -> dict:
    """Parameters partitioned by stock DeepSpeed (its zero.Init, its engine) are refused before any
    collective, on every rank alike."""
    import deepspeed

    cfg = ds_config({"secondary_level": "package"})
    stock_cfg = ds_config()
    with deepspeed.zero.Init(config_dict_or_path=stock_cfg):
        under_init = mlp()
    stock_engine = make_engine("stock", stock_cfg, mlp())
    refused = {
        "stock zero.Init": _refusal(lambda: make_engine("ours", cfg, under_init)),
        "stock engine": _refusal(lambda: make_engine("ours", cfg, stock_engine.module)),
    }
    stock_engine.destroy()
    return refused


def _primary_written_after_initialize(name: str, ckpt_dir: str) -> dict:
    """Forward outputs after adding 1 to every primary partition right after ``initialize`` (as
    DeepSpeed's TestZero3ParamPartitioningBase does), then after a checkpoint save."""
    kind, cfg = {
        "zero3": ("stock", ds_config()),
        "hpz": ("stock", ds_config(zero_hpz_partition_size=4)),
        "ours": ("ours", ds_config({"secondary_level": "node"})),
    }[name]
    engine = make_engine(kind, cfg, mlp())
    x = torch.randn(2, 13, generator=torch.Generator().manual_seed(7))
    for p in engine.module.parameters():
        p.ds_tensor.data.add_(1.0)
    with torch.no_grad():
        first = engine(x)
        again = engine(x)
        engine.save_checkpoint(ckpt_dir, tag="drops_the_secondary_copy")
        after_save = engine(x)
    engine.destroy()
    return {"first": first, "again": again, "after_save": after_save}


def _run_all(ckpt_dir: str) -> dict:
    return {
        "stock": _second_engine_on_the_same_module("stock", os.path.join(ckpt_dir, "stock")),
        "ours": _second_engine_on_the_same_module("ours", os.path.join(ckpt_dir, "ours")),
        "foreign": _foreign_partitions(),
        "written": {
            name: _primary_written_after_initialize(name, os.path.join(ckpt_dir, f"written_{name}"))
            for name in ("zero3", "hpz", "ours")
        },
    }


@pytest.fixture(scope="module")
def runs(run_ranks, tmp_path_factory):
    return run_ranks(TOPOLOGY.world_size, _run_all, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


def test_fresh_engine_on_a_trained_module_loads_saves_and_trains_as_stock_zero3(runs):
    for rank_runs in runs:
        stock, ours = rank_runs["stock"], rank_runs["ours"]
        assert ours["same_plan"]
        assert ours["saved"] == stock["saved"] and {"saved_at_once", "trained"} <= set(ours["saved"])
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(stock["losses"]), **TOL)
        for got, want in zip(ours["params"], stock["params"], strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_module_of_a_destroyed_engine_is_refused_naming_destroy(runs):
    for rank_runs in runs:
        assert "destroy() destroyed them" in rank_runs["ours"]["after_destroy"]


def test_stock_partitions_are_refused_naming_deepspeeds_own_zero3(runs):
    for rank_runs in runs:
        for source, message in rank_runs["foreign"].items():
            assert "already partitioned by DeepSpeed's own ZeRO-3" in message, (source, message)
            assert "deepspeed.zero.Init" in message and "deepspeed.initialize" in message, source


def test_primary_written_after_initialize_is_gathered_as_by_stock_zero3(runs):
    """The secondary copy made at partitioning is dropped by initialize: the first forward gathers
    the primary partition, as stock ZeRO-3 does; stock hpZ reads that copy until a step or a
    checkpoint drops it (docs/hierarchical_zero.md, "Which collective runs where")."""
    x = torch.randn(2, 13, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        untouched = mlp()(x)
        written = mlp()
        for p in written.parameters():
            p.add_(1.0)
        written = written(x)
    for rank_runs in runs:
        for name, out in rank_runs["written"].items():
            seen_at_once = untouched if name == "hpz" else written
            torch.testing.assert_close(out["first"], seen_at_once, **TOL, msg=name)
            torch.testing.assert_close(out["again"], seen_at_once, **TOL, msg=name)
            torch.testing.assert_close(out["after_save"], written, **TOL, msg=name)
