"""The MLP forward (fc1, gelu, fc2) under each communication schedule, instrumented.

Every schedule computes the same thing: x [s/N, b, h] (this rank's sequence slice) -> fc1
(column-parallel, all-gather of the sequence) -> gelu -> fc2 (row-parallel, reduce-scatter of the
sequence) -> [s/N, b, h]. A :class:`Recorder` keeps every compute slice and every wait of a step
with host timestamps; exposed communication = step time - compute time recorded in that step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

CHUNKS = 4  # Megatron / TransformerEngine "pipeline" overlap splits a GEMM in 4 by default


class Recorder:
    """Compute slices and waits of one step, as (kind, label, start, end) relative to the step start."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float, float]] = []
        self.t0 = time.perf_counter()

    def __call__(self, kind: str, label: str, start: float, end: float) -> None:
        self.events.append((kind, label, start - self.t0, end - self.t0))

    def compute(self, label: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        out = fn()
        self("compute", label, start, time.perf_counter())
        return out

    def wait(self, label: str, works: list[dist.Work]) -> None:
        start = time.perf_counter()
        for work in works:
            work.wait()
        self("wait", label, start, time.perf_counter())

    def total(self, kind: str) -> float:
        return sum(end - start for k, _, start, end in self.events if k == kind)


class MLP:
    """Weights of one rank: fc1 [f/N, h] and fc2 [h, f/N], held by the Flash-Overlap layers."""

    def __init__(self, hidden: int, ffn: int, group: dist.ProcessGroup, mode: str) -> None:
        from megatron.core.model_parallel_config import ModelParallelConfig

        n = group.size()
        config = ModelParallelConfig(
            tensor_model_parallel_size=n,
            sequence_parallel=True,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        init = torch.nn.init.xavier_normal_
        self.fc1 = FlashOverlapColumnParallelLinear(
            hidden,
            ffn,
            config=config,
            init_method=init,
            bias=False,
            tp_group=group,
            p2p_mode=mode,
            tp_comm_buffer_name="fc1",
        )
        self.fc2 = FlashOverlapRowParallelLinear(
            ffn,
            hidden,
            config=config,
            init_method=init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=group,
            p2p_mode=mode,
            tp_comm_buffer_name="fc2",
        )
        self.group, self.n, self.rank = group, n, group.rank()
        self.w1, self.w2 = self.fc1.weight.detach(), self.fc2.weight.detach()


def _gelu(rec: Recorder, y: torch.Tensor) -> torch.Tensor:
    return rec.compute("gelu", lambda: torch.nn.functional.gelu(y))


def _p2p_all_gather(mlp: MLP, shard: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """Direct-pattern P2P all-gather, each step waited at once (receive posted before send)."""
    n, r = mlp.n, mlp.rank
    parts = [shard] * n
    for step in range(1, n):
        src, dst = (r - step) % n, (r + step) % n
        parts[src] = torch.empty_like(shard)
        works = [dist.irecv(parts[src], src, tag=step), dist.isend(shard, dst, tag=step)]
        rec.wait(f"all-gather exchange {step}", works)
    return torch.cat(parts)


def _p2p_reduce_scatter(mlp: MLP, full: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """Direct-pattern P2P reduce-scatter of ``full`` [s, ...] along dim 0, each step waited at once."""
    n, r = mlp.n, mlp.rank
    slices = full.chunk(n)
    own = slices[r].clone()
    for step in range(1, n):
        src, dst = (r - step) % n, (r + step) % n
        buf = torch.empty_like(own)
        works = [dist.irecv(buf, src, tag=step), dist.isend(slices[dst].contiguous(), dst, tag=step)]
        rec.wait(f"reduce-scatter exchange {step}", works)
        own += buf
    return own


def sequential(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """No overlap: P2P exchange then GEMM; GEMM then P2P exchange."""
    gathered = _p2p_all_gather(mlp, x, rec)
    h = _gelu(rec, rec.compute("fc1", lambda: gathered @ mlp.w1.t()))
    full = rec.compute("fc2", lambda: h @ mlp.w2.t())
    return _p2p_reduce_scatter(mlp, full, rec)


def collective(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """gloo's own all_gather_into_tensor / reduce_scatter_tensor around unsliced GEMMs."""
    gathered = x.new_empty((x.shape[0] * mlp.n, *x.shape[1:]))
    rec.wait("all-gather", [dist.all_gather_into_tensor(gathered, x, group=mlp.group, async_op=True)])
    h = _gelu(rec, rec.compute("fc1", lambda: gathered @ mlp.w1.t()))
    full = rec.compute("fc2", lambda: h @ mlp.w2.t())
    out = torch.empty_like(x)
    rec.wait("reduce-scatter", [dist.reduce_scatter_tensor(out, full, group=mlp.group, async_op=True)])
    return out


def chunked(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """Data slicing (Megatron/TE "pipeline"): CHUNKS asynchronous collectives, each chunk's GEMM
    overlapping the next chunk's transfer; the first gather and the last reduce-scatter stay exposed."""
    n, k = mlp.n, CHUNKS
    q = x.shape[0] // k
    chunks = x.split(q)
    gathered = [x.new_empty((q * n, *x.shape[1:])) for _ in range(k)]
    works = [
        dist.all_gather_into_tensor(g, c.contiguous(), group=mlp.group, async_op=True)
        for g, c in zip(gathered, chunks)
    ]
    # Chunk-major layout: chunk i of every rank is one contiguous block, for fc1's output and fc2's input.
    y = x.new_empty((k, n * q, *x.shape[1:-1], mlp.w1.shape[0]))
    for i in range(k):
        rec.wait(f"all-gather chunk {i}", [works[i]])
        rec.compute(f"fc1 chunk {i}", lambda i=i: torch.matmul(gathered[i], mlp.w1.t(), out=y[i]))
    h = _gelu(rec, y)
    outs, rs_works = [], []
    for i in range(k):
        part = rec.compute(f"fc2 chunk {i}", lambda i=i: h[i] @ mlp.w2.t())
        outs.append(torch.empty_like(chunks[i]))
        rs_works.append(dist.reduce_scatter_tensor(outs[i], part, group=mlp.group, async_op=True))
    rec.wait("reduce-scatter (all chunks)", rs_works)
    return torch.cat(outs)


def flash_overlap(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """The Flash-Overlap layers themselves, tracing their compute slices and waits."""
    mlp.fc1.overlap = replace(mlp.fc1.overlap, trace=rec)
    mlp.fc2.overlap = replace(mlp.fc2.overlap, trace=rec)
    y, _ = mlp.fc1(x)
    out, _ = mlp.fc2(_gelu(rec, y))
    return out


Schedule = Callable[[MLP, torch.Tensor, Recorder], torch.Tensor]
METHODS: dict[str, Schedule] = {
    "p2p_sequential": sequential,
    "gloo_collectives": collective,
    f"chunked_{CHUNKS}": chunked,
    "flash_overlap": flash_overlap,
}


def compute_only(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """The same GEMMs unsliced on a full-sequence input, no communication: T_comp."""
    full = x.repeat(mlp.n, *([1] * (x.dim() - 1)))
    h = _gelu(rec, rec.compute("fc1", lambda: full @ mlp.w1.t()))
    return rec.compute("fc2", lambda: h @ mlp.w2.t())


def comm_only(mlp: MLP, x: torch.Tensor, rec: Recorder) -> torch.Tensor:
    """The P2P exchanges of the MLP alone (gather of x, reduce-scatter of an output): T_comm."""
    _p2p_all_gather(mlp, x, rec)
    return _p2p_reduce_scatter(mlp, x.repeat(mlp.n, *([1] * (x.dim() - 1))), rec)
