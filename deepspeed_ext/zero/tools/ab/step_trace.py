"""One traced step: every rank's spans, DeepSpeed's ZeRO-3 hooks timed beside the collectives.

While a :class:`StepTrace` is entered, a :class:`mdsp_base.spans.SpanLog` records, and four of
DeepSpeed's stage-3 methods are wrapped so that their host time shows as spans (undone on exit,
through an :class:`~mdsp_base.installer.Installer`):

- ``PartitionedParameterCoordinator.fetch_sub_module`` (``fetch``): before each module's forward
  and backward, launches its gathers and blocks until its parameters are whole: the gather wait;
- ``PartitionedParameterCoordinator.release_sub_module`` (``release``): frees them again;
- ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads`` (``reduce hook``): a gradient
  bucket's reduce-scatter and its copy into the partitions;
- ``DeepSpeedZeroOptimizer_Stage3.step`` (``optimizer``).

The collectives (``gather``, ``reduce``, ``launch``, ``wait``), the hops' queue and copies and a
virtual device's ops record themselves while the log is on (:mod:`mdsp_base.comm`,
:mod:`deepspeed_ext.zero.engine.hop_worker`, :mod:`deepspeed_ext.zero.engine.hops`). What the
trace sums to: :mod:`.trace_report`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch.distributed as dist

from mdsp_base import spans
from mdsp_base.installer import Installer

_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def _timed(method: Callable[..., Any], name: str, category: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        facts = {}
        if category == "fetch":  # fetch_sub_module(current_submodule, forward)
            facts["forward"] = bool(kwargs["forward"] if "forward" in kwargs else args[1])
        with spans.span(name, category, **facts):
            return method(self, *args, **kwargs)

    return timed


class StepTrace:
    """Context manager: the spans of everything run while entered (``spans``), this process's."""

    def __init__(self) -> None:
        self.spans: list[spans.Span] = []
        self._log = spans.SpanLog()
        self._installer = Installer()

    def __enter__(self) -> StepTrace:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        wrapped = (
            (PartitionedParameterCoordinator, "fetch_sub_module", "fetch parameters", "fetch"),
            (PartitionedParameterCoordinator, "release_sub_module", "release parameters", "release"),
            (DeepSpeedZeroOptimizer_Stage3, _REDUCE, "reduce gradients", "reduce hook"),
            (DeepSpeedZeroOptimizer_Stage3, "step", "optimizer step", "optimizer"),
        )
        for owner, attribute, name, category in wrapped:
            method = getattr(owner, attribute)
            self._installer.setattr(
                __name__, f"{owner.__name__}.{attribute} timed as '{category}' spans", owner, attribute,
                _timed(method, name, category),
            )  # fmt: skip
        self._log.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._log.__exit__()
        self._installer.close()
        self.spans = list(self._log.spans)


def gather_spans(mine: list[spans.Span]) -> list[list[spans.Span]] | None:
    """Every rank's spans on rank 0 (a collective: every rank calls it); None elsewhere."""
    rows = [(s.name, s.category, s.thread, s.start, s.end, s.args) for s in mine]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, out, dst=0)
    if out is None:
        return None
    return [[spans.Span(*row) for row in rank] for rank in out]
