"""Checkpoints keep the error feedback of quantized gradients, at 8 ranks (2 nodes x 2 packages x 2).

With ``quantized_gradients`` int8 or int4 each rank carries, per gradient bucket, the fp32 error of
what it last sent across nodes into its next step. A checkpoint saves it, so a run resumed from one
equals the uninterrupted run exactly: losses and parameters, bit for bit. Where the residuals
cannot be kept the load is refused or warned about, naming the setting and the fix. One pool call
builds every engine (engines are the expensive part); the assertions then read its results.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from deepspeed_ext.zero.engine import grad_sync
from mdsp_base.section import ConfigError
from tests.helpers.zero import MICRO, ds_config, full_params, make_engine, mlp, train

STEPS, SAVED_AT = 4, 2
BITS = ("int8", "int4")


def _refusal(load: Callable[[], object]) -> str:
    """The message of the ConfigError ``load()`` raises ("" when it loads)."""
    try:
        load()
    except ConfigError as error:
        return str(error)
    return ""


def _misfits(engine, ckpt_dir: str) -> dict[str, str]:
    """On a resumed quantized engine, the loads whose residuals cannot be kept: what each says."""
    optimizer, me = engine.optimizer, dist.get_rank(engine.optimizer.dp_process_group)
    mine = optimizer.state_dict()
    mine[grad_sync.CHECKPOINT_KEY]["layout"]["hops"] = [4, 2]  # as saved on 2 nodes x 4, one package
    states = [None] * dist.get_world_size(optimizer.dp_process_group)
    states[me] = mine
    said = {
        "universal": _refusal(lambda: optimizer.load_state_dict(None, checkpoint_folder=ckpt_dir)),
        "other layout": _refusal(lambda: optimizer.load_state_dict(states)),
    }
    with mock.patch.object(grad_sync.logger, "warning") as warn:
        grad_sync.restore_residuals(None, mine, universal=False)  # an engine without quantized_gradients
        del mine[grad_sync.CHECKPOINT_KEY]  # a checkpoint saved without them
        optimizer.load_state_dict(states)
    said["unquantized engine"], said["no residuals"] = (call.args[0] for call in warn.call_args_list)
    return said


def _runs(ckpt_dir: str) -> dict:
    """Per setting: the uninterrupted run; a run stopped after SAVED_AT steps with a checkpoint; a
    fresh engine resumed from it for the remaining steps."""
    rank, runs = dist.get_rank(), {}
    for bits in BITS:
        cfg = ds_config({"secondary_level": "package", "quantized_gradients": bits})
        engine = make_engine("ours", cfg, mlp())
        losses, _ = train(engine, range(STEPS), rank, MICRO)
        runs[bits] = {"uninterrupted": losses, "uninterrupted params": full_params(engine)}
        engine.destroy()
        engine = make_engine("ours", cfg, mlp())
        runs[bits]["before save"], _ = train(engine, range(SAVED_AT), rank, MICRO)
        engine.save_checkpoint(ckpt_dir, tag=bits)
        saved = engine.optimizer.state_dict()[grad_sync.CHECKPOINT_KEY]["buckets"]
        runs[bits]["largest residual"] = max(b["residual"].abs().max().item() for b in saved)
        engine.destroy()
        engine = make_engine("ours", cfg, mlp())
        engine.load_checkpoint(ckpt_dir, tag=bits)
        runs[bits]["resumed"], _ = train(engine, range(SAVED_AT, STEPS), rank, MICRO)
        runs[bits]["resumed params"] = full_params(engine)
        if bits == BITS[-1]:
            runs["misfits"] = _misfits(engine, ckpt_dir)
        engine.destroy()
    return runs


@pytest.fixture(scope="module")
def runs(run_ranks, tmp_path_factory):
    return run_ranks(8, _runs, str(tmp_path_factory.mktemp("ckpt")), timeout=300)


@pytest.mark.parametrize("bits", BITS)
def test_resumed_run_equals_the_uninterrupted_one_exactly(runs, bits):
    for rank_runs in runs:
        run = rank_runs[bits]
        assert run["largest residual"] > 0  # the checkpoint carries error feedback that matters
        assert run["before save"] + run["resumed"] == run["uninterrupted"]
        for got, want in zip(run["resumed params"], run["uninterrupted params"], strict=True):
            assert torch.equal(got, want)


def test_a_universal_checkpoint_is_refused_naming_the_setting_and_the_fix(runs):
    for rank_runs in runs:
        said = rank_runs["misfits"]["universal"]
        assert "quantized_gradients=int4" in said and "universal checkpoint cannot reshard" in said
        assert "checkpoint.load_universal false" in said and "quantized_gradients none" in said


def test_residuals_of_another_topology_are_refused(runs):
    for rank_runs in runs:
        said = rank_runs["misfits"]["other layout"]
        assert "[4, 2]" in said and "[2, 2, 2]" in said
        assert "resume with the topology and data-parallel size it was saved with" in said


def test_residuals_that_cannot_be_used_are_dropped_with_a_warning(runs):
    for rank_runs in runs:
        said = rank_runs["misfits"]
        assert "quantized_gradients none) does not use: they are dropped" in said["unquantized engine"]
        assert "error feedback starts again from zero" in said["no residuals"]
