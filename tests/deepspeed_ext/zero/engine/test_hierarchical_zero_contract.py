"""Where stock DeepSpeed ZeRO-3 accepts a call sequence, the hierarchical variant accepts it too, at
8 ranks (2 nodes x 2 packages x 2), and ends where stock ZeRO-3 ends; where it refuses, the error
names the real cause.

The sequence is the one of DeepSpeed's ``TestZeROSaveLoadEdgeCase::test_load_immediate_save``,
extended: train, save, build a fresh engine on the SAME module (DeepSpeed leaves its parameters
partitioned), load, save at once, destroy the first engine, train on. Stock DeepSpeed ZeRO-3 runs
the same sequence as the reference. The secondary weight copy exists from ``initialize`` on, as
stock hpZ's does: an eval-only forward loop right after ``initialize`` gathers from it and gives stock
hpZ's outputs, and a write to the primary partition right after ``initialize`` is not seen until a
step or a checkpoint drops the copy, as with stock hpZ (stock ZeRO-3, which has no copy, sees it).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.zero import TOL, TOPOLOGY, batch, ds_config, full_params, make_engine, mlp, train

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
    from mdsp_base.section import ConfigError

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


# Stock hpZ over 4 consecutive ranks is the node of TOPOLOGY: the variant's node level
HPZ_NODE = 4
EVAL_STEPS = 3


def _secondary_copies(engine) -> list[int | None]:
    """Elements of each parameter's secondary copy on this rank (None: no copy)."""
    return [
        None if p.ds_secondary_tensor is None else p.ds_secondary_tensor.numel()
        for p in engine.module.parameters()
    ]


def _eval_right_after_initialize(name: str) -> dict:
    """The secondary copies right after ``initialize`` and after each forward of an eval-only loop
    (no backward, no step: nothing drops the copy), with that loop's outputs (as DeepSpeed's
    ``TestZeroPPConfigSweep::test_eval``)."""
    kind, cfg = {
        "hpz": ("stock", ds_config(zero_hpz_partition_size=HPZ_NODE)),
        "ours": ("ours", ds_config({"secondary_level": "node"})),
    }[name]
    engine = make_engine(kind, cfg, mlp())
    engine.eval()
    copies = [_secondary_copies(engine)]
    outputs = []
    with torch.no_grad():
        for step in range(EVAL_STEPS):
            x, _ = batch(step, 0, dist.get_rank())
            outputs.append(engine(x))
            copies.append(_secondary_copies(engine))
    engine.destroy()
    return {"copies": copies, "outputs": outputs}


def _run_all(ckpt_dir: str) -> dict:
    return {
        "stock": _second_engine_on_the_same_module("stock", os.path.join(ckpt_dir, "stock")),
        "ours": _second_engine_on_the_same_module("ours", os.path.join(ckpt_dir, "ours")),
        "foreign": _foreign_partitions(),
        "written": {
            name: _primary_written_after_initialize(name, os.path.join(ckpt_dir, f"written_{name}"))
            for name in ("zero3", "hpz", "ours")
        },
        "eval": {name: _eval_right_after_initialize(name) for name in ("hpz", "ours")},
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


def test_secondary_copy_exists_from_initialize_on_as_stock_hpzs_does(runs):
    """Every parameter has its secondary copy right after ``initialize``, of stock hpZ's size over
    the node, and keeps it through an eval-only loop; that loop's outputs are stock hpZ's."""
    for rank_runs in runs:
        hpz, ours = rank_runs["eval"]["hpz"], rank_runs["eval"]["ours"]
        assert all(n is not None for n in hpz["copies"][0]), "stock hpZ: a copy from initialize on"
        assert ours["copies"] == hpz["copies"]
        assert len(ours["outputs"]) == len(hpz["outputs"]) == EVAL_STEPS
        for got, want in zip(ours["outputs"], hpz["outputs"], strict=True):
            torch.testing.assert_close(got, want, **TOL)


def test_primary_written_after_initialize_is_gathered_as_by_stock_hpz(runs):
    """The secondary copy made at partitioning is kept by ``initialize``, as stock hpZ keeps it:
    forwards gather that copy, so a write to the primary partition right after ``initialize`` is
    seen once a checkpoint (or a step) drops the copy; stock ZeRO-3, without a copy, sees it at once
    (docs/hierarchical_zero.md, "Which collective runs where")."""
    x = torch.randn(2, 13, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        untouched = mlp()(x)
        written = mlp()
        for p in written.parameters():
            p.add_(1.0)
        written = written(x)
    for rank_runs in runs:
        for name, out in rank_runs["written"].items():
            seen_at_once = written if name == "zero3" else untouched
            torch.testing.assert_close(out["first"], seen_at_once, **TOL, msg=name)
            torch.testing.assert_close(out["again"], seen_at_once, **TOL, msg=name)
            torch.testing.assert_close(out["after_save"], written, **TOL, msg=name)
