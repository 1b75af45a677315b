"""Combinations that cannot work fail at start-up, with a message naming the fix, before any collective."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from deepspeed_ext.zero import check_deepspeed_version, dp_shape
from mdsp_base.section import ConfigError
from mdsp_base.topology import Topology
from tests.helpers.zero import ds_config, mlp

COLLECTIVES = (
    "new_group",
    "new_subgroups",
    "all_gather_object",
    "all_gather",
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


class _Mpu:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group


def _startup_errors() -> dict[str, str]:
    import deepspeed

    from deepspeed_ext import zero

    uneven = dist.new_group([0, 1, 2])  # made before the guard: a DP group of 3 in a job of 4
    # DeepSpeed's backend object keeps the torch collectives it finds when it is made: made before
    # the guard, so that it keeps the real ones for the later tests of this process.
    deepspeed.comm.init_distributed(dist_backend="gloo")
    cases = {
        "stage": (ds_config({}, stage=2), None, Topology(4, 2, 1)),
        "hpz": (ds_config({}, zero_hpz_partition_size=2), None, Topology(4, 2, 1)),
        "qgz": (ds_config({}, zero_quantized_gradients=True), None, Topology(4, 2, 1)),
        "qwz": (ds_config({}, zero_quantized_weights=True), None, Topology(4, 2, 1)),
        "node_size": ({**ds_config({}), "topology": {"ranks_per_node": 3}}, None, None),
        "dp_size": (ds_config({}), _Mpu(uneven) if dist.get_rank() < 3 else None, Topology(4, 2, 1)),
        "level": (ds_config({"secondary_level": "rack"}), None, Topology(4, 2, 1)),
        "flat_boundary": (
            ds_config({"grad_reduce": "flat", "grad_sync": "accumulation_boundary"}),
            None,
            Topology(4, 2, 1),
        ),
        "unmanaged": (
            {**ds_config({"grad_sync": "accumulation_boundary"}), "managed_gradient_accumulation": False},
            None,
            Topology(4, 2, 1),
        ),
    }
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran before the configuration was checked")

    messages = {}
    try:
        for name in COLLECTIVES:
            setattr(dist, name, forbidden)
        for case, (cfg, mpu, topology) in cases.items():
            if case == "dp_size" and mpu is None:
                continue
            try:
                zero.initialize(model=mlp(), config=cfg, mpu=mpu, topology=topology)
            except ConfigError as e:
                messages[case] = str(e)
            else:
                messages[case] = "no error"
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return messages


def test_impossible_combinations_fail_before_any_collective(run_ranks):
    messages = run_ranks(4, _startup_errors)[0]
    expect = {
        "stage": "needs zero_optimization.stage 3",
        "hpz": "remove zero_hpz_partition_size",
        "qgz": "zero_quantized_gradients=true (qgZ) cannot be combined",
        "qwz": "zero_quantized_weights=true (qwZ) cannot be combined",
        "node_size": "ranks_per_node(3)",
        "dp_size": "data-parallel size 3 does not divide world(4)",
        "level": "hierarchical_zero.secondary_level='rack'",
        "flat_boundary": "which grad_reduce=flat does not have: set grad_reduce to hierarchical",
        "unmanaged": "managed_gradient_accumulation=false hides: remove that key",
    }
    for case, text in expect.items():
        assert text in messages[case], (case, messages[case])


def test_uneven_levels_and_unsupported_deepspeed_are_named():
    with pytest.raises(ConfigError, match="members per package"):
        dp_shape(Topology(8, 4, 2), [0, 1, 2, 4, 5])
    with pytest.raises(ConfigError, match=r"supports DeepSpeed 0\.19\.x, found 0\.18\.3"):
        check_deepspeed_version("0.18.3")
    shape = dp_shape(Topology(8, 4, 2), [1, 3, 5, 7])  # TP=2: one member per package
    assert (shape.nodes, shape.packages_per_node, shape.per_package) == (2, 2, 1)
