"""engine.destroy() of a hierarchical engine leaves the process as it found it: the process-group
count, DeepSpeed's swapped functions and globals, its communication backend object, and the
threads (the hop worker is stopped)."""

from __future__ import annotations

import torch

from mdsp_base.topology import Topology
from tests.helpers.zero import batch, ds_config, mlp, reset_deepspeed_globals

FOUR_RANKS = Topology(world_size=4, ranks_per_node=2, ranks_per_package=1)  # 2 nodes x 2 packages: real hops


def _process_state() -> dict:
    import threading

    import deepspeed
    from deepspeed.comm import comm as ds_comm
    from deepspeed.runtime.zero import partition_parameters, stage3
    from deepspeed.utils import groups
    from torch.distributed.distributed_c10d import _world

    return {
        "process groups": len(_world.pg_map),
        "partition_parameters._dist_allgather_fn": partition_parameters._dist_allgather_fn,
        "stage3.reduce_scatter_coalesced": stage3.reduce_scatter_coalesced,
        "deepspeed.comm.all_gather_into_tensor": deepspeed.comm.all_gather_into_tensor,
        "threads": sorted(t.name for t in threading.enumerate()),
        "stage3.DeepSpeedZeroOptimizer_Stage3": stage3.DeepSpeedZeroOptimizer_Stage3,
        "groups.mpu": groups.mpu,
        "groups._ZERO_PARAM_INTRA_PARALLEL_GROUP": groups._ZERO_PARAM_INTRA_PARALLEL_GROUP,
        "backend object attributes": dict(ds_comm.cdb.__dict__),
    }


def _init_train_destroy_three_times() -> list[list[str]]:
    import deepspeed
    import torch.distributed as dist

    from deepspeed_ext import zero

    deepspeed.comm.init_distributed(dist_backend="gloo")  # DeepSpeed's backend exists before the first engine
    start = _process_state()
    changed_per_cycle = []
    for _ in range(3):
        model = mlp()
        cfg = ds_config({"secondary_level": "node", "grad_sync": "accumulation_boundary"}, micro=2)
        engine, *_ = zero.initialize(
            model=model, config=cfg, topology=FOUR_RANKS, model_parameters=model.parameters()
        )
        assert _process_state()["process groups"] > start["process groups"]
        for micro in range(2):
            x, y = batch(0, micro, dist.get_rank())
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        engine.destroy()
        now = _process_state()
        changed_per_cycle.append([key for key in start if now[key] != start[key]])
    return changed_per_cycle


def test_init_and_destroy_three_times_restores_groups_and_deepspeeds_functions(run_ranks):
    for rank, changed in enumerate(run_ranks(4, _init_train_destroy_three_times, timeout=180)):
        assert changed == [[], [], []], f"rank {rank}: left changed after each destroy: {changed}"


def _initialize_under_an_installer() -> dict:
    import deepspeed

    from deepspeed_ext import zero
    from mdsp_base.installer import Installer

    deepspeed.comm.init_distributed(dist_backend="gloo")
    reset_deepspeed_globals()  # an earlier run in this worker may have left DeepSpeed's groups behind
    recorded = {}
    for name, hierarchical in (("off", None), ("on", {"secondary_level": "node"})):
        model = mlp()
        start = _process_state()  # a stock engine leaves DeepSpeed's groups behind: only ours is compared
        with Installer() as installer:
            zero.initialize(
                model=model,
                config=ds_config(hierarchical),
                topology=FOUR_RANKS,
                model_parameters=model.parameters(),
                installer=installer,
            )
            recorded[name] = [(c.owner, c.what) for c in installer.changes]
    now = _process_state()
    return {"recorded": recorded, "changed": [key for key in start if now[key] != start[key]]}


def test_initialize_records_its_engine_on_the_installer_with_the_variant_on_or_off(run_ranks):
    from deepspeed_ext.zero.engine.inject import ENGINE_CHANGES

    for rank, result in enumerate(run_ranks(4, _initialize_under_an_installer, timeout=180)):
        assert result["recorded"] == {
            "off": [("deepspeed_ext.zero", ENGINE_CHANGES)],
            "on": [("deepspeed_ext.zero", ENGINE_CHANGES)],
        }, f"rank {rank}"
        assert result["changed"] == [], f"rank {rank}: left changed after the installer closed"
