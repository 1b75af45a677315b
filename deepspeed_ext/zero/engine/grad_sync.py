"""The gradient reduce-scatter of one hierarchical engine, with DeepSpeed's contract.

Hops inside the node run every micro-batch; the hop across nodes every micro-batch, or with
``grad_sync: accumulation_boundary`` once per optimizer step on the held fp32 sums, optionally
quantized with error feedback (:mod:`.quantize`). Held blocks and residuals belong to the k-th
bucket since the last forward, checked at every call; residuals go into checkpoints
(:data:`CHECKPOINT_KEY`). Details: docs/hierarchical_zero_modules.md."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.zero.engine import hops, quantize
from deepspeed_ext.zero.engine.hop_worker import HopWorker
from deepspeed_ext.zero.engine.levels import HopSchedule
from mdsp_base import spans
from mdsp_base.section import ConfigError
from mdsp_base.topology import LinkClass

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "hierarchical_zero_residuals"
"""Key of each rank's ZeRO optimizer state (its checkpoint file) that holds its residuals."""


@dataclass
class _Bucket:
    chunks: tuple[int, ...]
    """Chunk length per tensor: the layout the held state belongs to."""
    held: torch.Tensor | None = None
    """fp32 node-level block summed over this step's micro-batches (boundary sync)."""
    residual: torch.Tensor | None = None
    """fp32 quantization error of what this rank last sent across nodes (error feedback)."""


class GradientReducer:
    """``reduce_scatter_coalesced`` over a data-parallel group, in the hops of ``plan``."""

    def __init__(
        self, plan: HopSchedule, at_boundary: bool, grad_bits: int | None, block: int, pieces: int = 1
    ) -> None:
        self.plan = plan
        crossing = [
            i
            for i, (s, link) in enumerate(zip(plan.sizes, plan.links))
            if s > 1 and link == LinkClass.INTER_NODE
        ]
        self._cross = crossing[0] if crossing else None
        self.at_boundary = at_boundary and self._cross is not None
        self.grad_bits = grad_bits if self._cross is not None else None
        self.block = block
        self.pieces = pieces
        """Pieces a plain reduce-scatter is pipelined in (the boundary and quantized hops run whole)."""
        self._buckets: list[_Bucket] = []
        self._cursor = 0
        self._is_boundary: Callable[[], bool] = lambda: True
        self._warned = False
        self.peak_bytes = 0
        """Most bytes held at once in blocks and residuals (memory the variant adds)."""

    def bind(self, is_boundary: Callable[[], bool]) -> None:
        """Where to read whether the running micro-batch ends the step (the ZeRO optimizer)."""
        self._is_boundary = is_boundary

    def start_micro_batch(self) -> None:
        """A forward began: the next call is bucket 0 again."""
        self._cursor = 0

    def check_flushed(self) -> None:
        """Before the optimizer step: no gradient may still wait for its cross-node hop."""
        waiting = [i for i, b in enumerate(self._buckets) if b.held is not None]
        if waiting:
            raise RuntimeError(
                f"hierarchical_zero: gradient buckets {waiting} were held for the accumulation boundary but "
                "the boundary micro-batch did not reduce them (a parameter got no gradient there): set "
                "hierarchical_zero.grad_sync to every_micro_batch for this model"
            )

    @property
    def _plain(self) -> bool:
        """Every hop every micro-batch, none quantized."""
        return self._cross is None or not (self.at_boundary or self.grad_bits)

    def reduce(self, tensors: Sequence[torch.Tensor], worker: HopWorker) -> list[torch.Tensor]:
        """The reduce-scatter on ``worker``: pipelined in :attr:`pieces` when plain, else whole."""
        if self.pieces == 1 or not self._plain:
            return worker.run(tensors[0].device, functools.partial(self, tensors))
        buffer, chunks = hops.pack(tensors, self.plan, self.pieces)
        results: list[torch.Tensor] = []
        worker.submit_stages(tensors[0].device, hops.reduce_scatter_stages(self.plan, buffer, results)).wait()
        with spans.span("join reduced pieces", "copy"):
            mine = torch.cat(results)
        return hops.unpack(mine, tensors, chunks, self.plan.parent.index(dist.get_rank()))

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        plan = self.plan
        buffer, chunks = hops.pack(tensors, plan)
        held = buffer[0]
        me = plan.parent.index(dist.get_rank())
        if self._plain:
            return hops.unpack(
                hops.reduce_scatter_hops(plan, held, range(len(plan.sizes))), tensors, chunks, me
            )
        assert self._cross is not None  # not plain: a hop crosses nodes
        node_block = hops.reduce_scatter_hops(plan, held, range(self._cross))
        bucket = self._bucket(tuple(chunks))
        if self.at_boundary and not self._is_boundary():
            if bucket.held is None:  # a copy: ``node_block`` is a view into the whole bucket
                bucket.held = node_block.to(torch.float32, copy=True)
            else:
                bucket.held.add_(node_block)
            self._track_memory()
            zeros = node_block.new_zeros(node_block.numel() // plan.sizes[self._cross])
            return hops.unpack(zeros, tensors, chunks, me)
        self._track_memory()
        if bucket.held is not None:
            node_block = bucket.held.add_(node_block).to(node_block.dtype)
            bucket.held = None
        if self.grad_bits:
            # a residual loaded from a checkpoint stays on the CPU until its bucket's first call
            residual = None if bucket.residual is None else bucket.residual.to(node_block.device)
            mine, bucket.residual = quantize.reduce_scatter_quantized(
                node_block, plan.groups[self._cross], self.grad_bits, self.block, residual
            )
        else:
            mine = hops.reduce_scatter_hops(plan, node_block, range(self._cross, len(plan.sizes)))
        return hops.unpack(mine, tensors, chunks, me)

    def residual_state(self) -> dict[str, Any]:
        """This rank's error feedback for a checkpoint: the layout its elements belong to, and per
        bucket its chunks and residual. The residuals are saved where they live, without a copy (a call
        replaces its bucket's residual, never writes into it), as DeepSpeed saves its fp32 partitions."""
        return {
            "layout": self._layout(),
            "buckets": [{"chunks": list(b.chunks), "residual": b.residual} for b in self._buckets],
        }

    def load_residual_state(self, state: dict[str, Any] | None) -> None:
        """Replace the error feedback with ``state`` (:meth:`residual_state` of this DP rank; None: a
        checkpoint without residuals, after which feedback starts from zero, with a warning). A
        residual of another layout holds other elements of the gradient, so it is refused; a bucket
        whose chunks differ at its first call starts again (:meth:`_bucket`)."""
        if state is None:
            logger.warning(
                "hierarchical_zero: the checkpoint holds no error-feedback residuals (it was saved with "
                "quantized_gradients none or by an older version), so the quantized gradients' error "
                "feedback starts again from zero"
            )
            self._buckets = []
            return
        if state["layout"] != self._layout():
            raise ConfigError(
                f"hierarchical_zero.quantized_gradients: the checkpoint's error-feedback residuals were "
                f"saved with the layout {state['layout']}, this engine's is {self._layout()}: resume with the "
                "topology and data-parallel size it was saved with, or with quantized_gradients none"
            )
        self._buckets = [_Bucket(tuple(b["chunks"]), residual=b["residual"]) for b in state["buckets"]]
        self._track_memory()

    def _layout(self) -> dict[str, Any]:
        """What a residual's elements are: the hops' sizes, which one crosses nodes, this rank's place."""
        return {
            "hops": list(self.plan.sizes),
            "cross": self._cross,
            "position": self.plan.parent.index(dist.get_rank()),
        }

    def _track_memory(self) -> None:
        held = [t for b in self._buckets for t in (b.held, b.residual) if t is not None]
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in held))

    def _bucket(self, chunks: tuple[int, ...]) -> _Bucket:
        index = self._cursor
        self._cursor += 1
        if index == len(self._buckets):
            self._buckets.append(_Bucket(chunks))
        bucket = self._buckets[index]
        if bucket.chunks == chunks:
            return bucket
        if bucket.held is not None:
            raise RuntimeError(
                f"hierarchical_zero: gradient bucket {index} of this micro-batch has {len(chunks)} tensors "
                f"(chunks {chunks[:4]}...), the one held from the previous micro-batch {len(bucket.chunks)} "
                f"(chunks {bucket.chunks[:4]}...): grad_sync accumulation_boundary needs the same buckets "
                "every micro-batch; set hierarchical_zero.grad_sync to every_micro_batch for this model"
            )
        if not self._warned:
            logger.warning(
                "hierarchical_zero: gradient bucket %d changed layout; its quantization error feedback "
                "starts again (logged once)",
                index,
            )
            self._warned = True
        self._buckets[index] = _Bucket(chunks)
        return self._buckets[index]


def restore_residuals(
    reducer: GradientReducer | None, rank_state: dict[str, Any] | None, universal: bool
) -> None:
    """Before DeepSpeed loads a checkpoint's optimizer state: its residuals into ``reducer``
    (``rank_state``: this rank's optimizer state). A universal checkpoint is resharded, which a
    residual (per rank, in the node-block layout of the DP group) cannot be, so a quantizing engine
    refuses it; an engine that does not quantize drops the residuals, saying so."""
    quantized = reducer is not None and reducer.grad_bits
    if universal:
        if quantized:
            assert reducer is not None
            raise ConfigError(
                f"hierarchical_zero.quantized_gradients=int{reducer.grad_bits} keeps per-rank error-feedback "
                "residuals that a universal checkpoint cannot reshard: set checkpoint.load_universal false "
                "and resume from the ZeRO checkpoint at the data-parallel size and topology it was saved "
                "with, or set quantized_gradients none"
            )
        return
    state = None if rank_state is None else rank_state.get(CHECKPOINT_KEY)
    if quantized:
        assert reducer is not None
        reducer.load_residual_state(state)
    elif state is not None and any(b["residual"] is not None for b in state["buckets"]):
        logger.warning(
            "hierarchical_zero: the checkpoint holds error-feedback residuals of quantized gradients, "
            "which this engine (quantized_gradients none) does not use: they are dropped"
        )
