"""A Megatron model built partitioned by hierarchical ZeRO-3 from construction (main job and
Megatron-DeepSpeed alike): no rank ever holds it whole.

The plan needs the parameters before they exist: the model's own constructor runs once with its
large tensors on the meta device (:func:`deepspeed_ext.zero.engine.meta_build.spec_on_meta`), with
Megatron's tensor-parallel RNG tracker restored after, so the real build under
``deepspeed_ext.zero.Init`` draws exactly the numbers a build without the plan would draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.zero.cost.volume import ShardSpec
from deepspeed_ext.zero.engine.hierarchical_plan import HierarchicalPlan, Sections
from mdsp_base.installer import Installer
from mdsp_base.topology import Topology


def megatron_model_spec(build: Callable[[], torch.nn.Module], ds: dict) -> ShardSpec:
    """The :class:`ShardSpec` of ``build()`` from a meta-device build; Megatron's
    model-parallel RNG states (small tensors are built for real, some under the tracker's fork) are
    as before."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from deepspeed_ext.zero.engine.meta_build import spec_on_meta

    def kept() -> torch.nn.Module:
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        try:
            return build()
        finally:
            tracker.set_states(states)

    return spec_on_meta(kept, ds)


def partitioned_plan(
    build: Callable[[], torch.nn.Module],
    ds: dict,
    sections: Sections,
    mpu: Any,
    installer: Installer,
    topology: Topology | None = None,
) -> HierarchicalPlan:
    """The hierarchical plan of ``build``'s model, made from a meta-device build before the model
    exists; its groups and hop routes are recorded on ``installer``.

    Args:
        build: makes the model (called here on the meta device only).
        ds: the DeepSpeed config.
        sections: the effective plugin configuration (its hierarchical_zero and topology sections).
        mpu: the model-parallel unit whose (sequence-)data-parallel group is partitioned over.
        installer: the job's owner of process-wide changes.
        topology: the ranks' placement; None: detected from ``sections``.

    Returns:
        The plan: build the model under ``deepspeed_ext.zero.Init(plan.levels, ...)``, then pass
        the plan to ``deepspeed_ext.zero.initialize``.
    """
    from deepspeed_ext.zero import prepare
    from deepspeed_ext.zero.engine.construction import INIT_CHANGES
    from deepspeed_ext.zero.engine.inject import unregister

    plan = prepare(megatron_model_spec(build, ds), ds, sections, mpu=mpu, topology=topology)
    installer.add("deepspeed_ext.zero", INIT_CHANGES, lambda: unregister(plan.levels))
    if dist.get_rank() == 0:
        print(
            f"hierarchical_zero: the model is built partitioned over {len(plan.levels.dp_ranks)} ranks "
            f"(secondary level {plan.levels.secondary_level})",
            flush=True,
        )
    return plan


@contextlib.contextmanager
def hierarchical_init(
    build: Callable[[], torch.nn.Module],
    ds: dict,
    sections: Sections,
    mpu: Any,
    installer: Installer,
    topology: Topology | None = None,
) -> Iterator[HierarchicalPlan]:
    """``deepspeed_ext.zero.Init`` on the :func:`partitioned_plan` of ``build``'s model: call
    ``build()`` inside, and each module is partitioned over the plan's groups as it is made.

    Returns:
        A context manager giving the plan, for ``deepspeed_ext.zero.initialize(plan=...)``.
    """
    from deepspeed_ext.zero import Init

    plan = partitioned_plan(build, ds, sections, mpu, installer, topology)
    with Init(plan.levels, config_dict_or_path=ds, mpu=mpu):
        yield plan
