"""Every hierarchical plan of this process, found again by the DP group a model is partitioned over.

Callers pass the plan to ``initialize`` where they can. This registry stays for the two calls that
cannot carry it: a second engine on a module DeepSpeed left partitioned by the first (a checkpoint
loaded into a fresh engine, as DeepSpeed's own tests do), and Megatron-DeepSpeed's own
``deepspeed.initialize`` call after its ``zero.Init`` built the model; both only hand over the model,
whose parameters name their partition group. Entries are never dropped, so that a destroyed plan is
still told apart from a foreign partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from deepspeed_ext.zero.engine.hierarchical_plan import HierarchicalPlan
from mdsp_base.section import ConfigError


@dataclass
class KnownPlan:
    """A plan :func:`~.api.prepare` made in this process, found again by its DP group."""

    dp_group: dist.ProcessGroup
    """Held, so that its id is not reused by another group while the entry exists."""
    plan: HierarchicalPlan
    """The plan."""
    engines: int = 0
    """Engines built on it and not destroyed: the last one's ``destroy()`` destroys its groups."""


_known: dict[int, KnownPlan] = {}  # by the id of the plan's DP group


def plan_of_partition(model: torch.nn.Module, plan: HierarchicalPlan | None) -> KnownPlan | None:
    """The known plan over whose DP group the model's parameters are already partitioned (by an
    earlier engine on this module or by our ``Init``), None when none is partitioned. Refuses a
    partition it cannot continue, naming its cause."""
    groups = {
        id(p.ds_process_group): p.ds_process_group
        for p in model.parameters()
        if hasattr(p, "ds_process_group")
    }
    if not groups:
        return None
    known = [_known.get(key) for key in groups]
    if any(entry is None or entry.dp_group is not groups[key] for key, entry in zip(groups, known)):
        raise ConfigError(
            "the model's parameters are already partitioned by DeepSpeed's own ZeRO-3 (a deepspeed.zero.Init, "
            "or an engine deepspeed.initialize built on this module) over a group that is not one of "
            "hierarchical_zero's, and ZeRO-3 cannot partition them again: build the model without "
            "deepspeed.zero.Init (or under deepspeed_ext.zero.Init(plan.levels) and pass plan=plan), "
            "or a fresh model for the hierarchical engine"
        )
    entries = cast(list[KnownPlan], known)  # none is None: refused above
    if len({id(entry.plan) for entry in entries}) > 1:
        raise ConfigError(
            "the model's parameters are partitioned by several hierarchical plans (modules of different "
            "engines put together): build the model again, under one deepspeed_ext.zero.Init at most"
        )
    entry = entries[0]
    if not entry.plan.levels.groups.groups:
        raise ConfigError(
            "the model's parameters are partitioned over the groups of a hierarchical engine whose destroy() "
            "destroyed them: build the model again, or build the new engine before destroying the old one"
        )
    if plan is not None and plan is not entry.plan:
        raise ConfigError(
            "the model's parameters are partitioned by another plan than the plan= given (an earlier engine's, "
            "or the one its deepspeed_ext.zero.Init used): pass that plan (engine.hierarchical_zero) or none"
        )
    return entry


def remember(plan: HierarchicalPlan) -> KnownPlan:
    """The entry of ``plan``, made on first sight."""
    group = plan.levels.dp_group
    return _known.setdefault(id(group), KnownPlan(group, plan))
