"""Collective wrappers that count the bytes each rank sends, per link class and training phase.

Each collective is charged the bandwidth-optimal volume per rank (the ZeRO++ paper's "cross-node
volume"), all of it on the slowest link class its group spans (``package``, ``node`` or
``inter_node``); :mod:`deepspeed_ext.zero.cost.volume` predicts the same numbers. Two ways in: our own
hops call the wrappers here, and :func:`patch_deepspeed_comm` wraps DeepSpeed's communication
backend, so stock ZeRO-3, ZeRO++ and ours are counted alike while a :class:`CommCounter` is active
(:func:`counting`). Alongside, each rank books the bytes it sends on each physical link
(:mod:`mdsp_base.links`); :func:`nic_bytes_per_step` sums them and reports the most loaded NIC.
While a :class:`mdsp_base.spans.SpanLog` records, every collective through either way is also a
span named by its collective and link class (an asynchronous one: its launch, its wait, and its
time in flight from launch until the wait returned)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mdsp_base import spans
from mdsp_base.links import PhysicalLink, Transfer, link_count, links_crossed, sends
from mdsp_base.topology import Topology
from mdsp_base.volume import LINK_CLASSES, CallKey, span_class, volume

# torch 2.13 deprecates the *_tensor names (a FutureWarning per call on gloo); the *_single ones are
# the same collectives under their new names. Older torch has only the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (None is the whole job)."""
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


class CommCounter:
    """Bytes per (phase, kind, link class) sent by this rank while active, and per physical link."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._phase = threading.local()  # per thread: hops run on a worker thread for the caller's phase
        self._lock = threading.Lock()
        self.bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        # (phase, kind, physical link, link id) -> bytes of the transfers this rank sent across it
        self.links: dict[tuple[str, str, PhysicalLink, int], int] = defaultdict(int)
        # launches per collective shape: what a cost model charges one by one
        self.calls: dict[CallKey, int] = defaultdict(int)
        self._groups: dict[int, tuple[Any, str, list[int]]] = {}

    def _group(self, group: dist.ProcessGroup | None) -> tuple[str, list[int]]:
        cached = self._groups.get(id(group))
        if cached is None or cached[0] is not group:  # an id can be reused once a group is gone
            ranks = group_ranks(group)
            cached = (group, span_class(self.topology, ranks), ranks)
            self._groups[id(group)] = cached
        return cached[1], cached[2]

    def link_class(self, group: dist.ProcessGroup | None) -> str:
        return self._group(group)[0]

    def record(
        self, kind: str, collective: str, nbytes: int, group: dist.ProcessGroup | None, peer: int = 0
    ) -> None:
        """Bytes of one send or collective; a library collective (not a point-to-point send) is also
        counted as one ring launch. ``peer``: the receiver's group rank (p2p), the root's (broadcast)."""
        size = dist.get_world_size(group)
        if size <= 1:
            return
        with self._lock:
            link, ranks = self._group(group)
            phase, me = self.current_phase, dist.get_rank()
            self.bytes[(phase, kind, link)] += volume(collective, nbytes, size)
            if collective == "p2p":
                moves = [Transfer(me, ranks[peer], nbytes)]
            else:
                self.calls[CallKey(collective, "ring", link, size, nbytes)] += 1
                moves = sends(collective, "ring", nbytes, ranks, me, root=peer)
            for move in moves:
                for physical, index in links_crossed(self.topology, move.src, move.dst):
                    self.links[(phase, kind, physical, index)] += move.nbytes

    def count_launch(self, collective: str, algorithm: str, nbytes: int, group: dist.ProcessGroup) -> None:
        """One launch of a point-to-point ``algorithm`` (its sends count their own bytes)."""
        size = dist.get_world_size(group)
        if size > 1:
            with self._lock:
                self.calls[CallKey(collective, algorithm, self.link_class(group), size, nbytes)] += 1

    @property
    def current_phase(self) -> str:
        """The phase this thread's collectives are attributed to."""
        return getattr(self._phase, "name", "other")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what runs inside to ``name`` (forward, backward, step, ...)."""
        previous, self._phase.name = self.current_phase, name
        try:
            yield
        finally:
            self._phase.name = previous

    def per_link(self, phase: str | None = None, kind: str | None = None) -> dict[str, int]:
        """Bytes per link class, summed over the phases and kinds that match (None matches all)."""
        out: dict[str, int] = dict.fromkeys(LINK_CLASSES, 0)
        for (ph, kd, link), n in self.bytes.items():
            if (phase is None or ph == phase) and (kind is None or kd == kind):
                out[link] += n
        return out

    def physical_links(
        self, phase: str | None = None, kind: str | None = None
    ) -> dict[PhysicalLink, dict[int, int]]:
        """Bytes per physical link (kind -> link id -> bytes) of the transfers this rank sent,
        summed over the phases and kinds that match (None matches all). Sum it over the ranks for
        each link's load (:func:`nic_bytes_per_step`)."""
        out: dict[PhysicalLink, dict[int, int]] = {physical: {} for physical in PhysicalLink}
        for (ph, kd, physical, index), n in self.links.items():
            if (phase is None or ph == phase) and (kind is None or kd == kind):
                out[physical][index] = out[physical].get(index, 0) + n
        return out

    def snapshot(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {link: bytes}}}`` as plain dicts (JSON-ready)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (ph, kd, link), n in sorted(self.bytes.items()):
            out.setdefault(ph, {}).setdefault(kd, dict.fromkeys(LINK_CLASSES, 0))[link] += n
        return out

    def reset(self) -> None:
        self.bytes.clear()
        self.links.clear()
        self.calls.clear()


_MIB = 1 << 20


def nic_bytes_per_step(
    counter: CommCounter,
    steps: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """MiB per step on the most loaded NIC (its egress) and the most loaded package link, over what
    ``counter`` booked in ``steps`` steps on every rank of ``group`` (None: the job). Collective over
    ``group`` (its tensor on ``device``, where the backend needs it): every member calls it; the sum
    is not counted."""
    kinds = (PhysicalLink.NIC_EGRESS, PhysicalLink.PACKAGE)
    sizes = [link_count(counter.topology, physical) for physical in kinds]
    vector = torch.zeros(sum(sizes), dtype=torch.float64, device=device)  # exact up to 2**53 bytes
    loads, at = counter.physical_links(), 0
    for physical, size in zip(kinds, sizes, strict=True):
        for index, n in loads[physical].items():
            vector[at + index] += n
        at += size
    dist.all_reduce(vector, group=group)
    nic, package = vector.split(sizes)
    most = [float(part.max()) if part.numel() else 0.0 for part in (nic, package)]
    return {"nic_mib_per_step": most[0] / steps / _MIB, "package_link_mib_per_step": most[1] / steps / _MIB}


_active: CommCounter | None = None


@contextlib.contextmanager
def counting(counter: CommCounter) -> Iterator[CommCounter]:
    """Count every collective sent through this module or DeepSpeed's backend into ``counter``."""
    global _active
    previous, _active = _active, counter
    try:
        yield counter
    finally:
        _active = previous


def active_counter() -> CommCounter | None:
    return _active


def _record(kind: str, collective: str, nbytes: int, group: dist.ProcessGroup | None, peer: int = 0) -> None:
    if _active is not None:
        _active.record(kind, collective, nbytes, group, peer)


def count_launch(collective: str, algorithm: str, nbytes: int, group: dist.ProcessGroup) -> None:
    """Count one launch of a point-to-point algorithm in the active counter, if any."""
    if _active is not None:
        _active.count_launch(collective, algorithm, nbytes, group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> Any:
    """``output`` = concatenation of every member's ``input`` in group-rank order."""
    _record("gather", "all_gather", _nbytes(output), group)
    call = functools.partial(_ALL_GATHER, output, input, group=group, async_op=async_op)
    return _traced("gather", "all_gather", _nbytes(output), group, async_op, call)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``output`` = this member's block of the element-wise reduction of every member's ``input``."""
    _record("reduce", "reduce_scatter", _nbytes(input), group)
    call = functools.partial(_REDUCE_SCATTER, output, input, op=op, group=group, async_op=async_op)
    return _traced("reduce", "reduce_scatter", _nbytes(input), group, async_op, call)


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, kind: str = "reduce"
) -> Any:
    """``output`` row ``i`` = member ``i``'s input row for this member (equal splits)."""
    _record(kind, "all_to_all", _nbytes(input), group)
    call = functools.partial(dist.all_to_all_single, output, input, group=group)
    return _traced(kind, "all_to_all", _nbytes(input), group, False, call)


def send_recv(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup,
    kind: str,
) -> None:
    """One step of a point-to-point algorithm: post every (tensor, group rank) send and receive at
    once, then wait for all of them. The i-th send to a peer matches that peer's i-th receive from
    this rank (tags count per peer)."""
    ops = []
    for op, pairs in ((dist.isend, sends), (dist.irecv, recvs)):
        tags: dict[int, int] = {}
        for tensor, peer in pairs:
            if op is dist.isend:
                _record(kind, "p2p", _nbytes(tensor), group, peer)
            tags[peer] = tags.get(peer, -1) + 1
            ops.append(dist.P2POp(op, tensor, group=group, group_peer=peer, tag=tags[peer]))
    if ops:
        nbytes = sum(_nbytes(tensor) for tensor, _ in sends)
        _traced(kind, "p2p", nbytes, group, False, functools.partial(_exchange, ops))


def _exchange(ops: list[dist.P2POp]) -> None:
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    _record("other", "all_reduce", _nbytes(tensor), group)
    call = functools.partial(dist.all_reduce, tensor, op=op, group=group, async_op=async_op)
    return _traced("other", "all_reduce", _nbytes(tensor), group, async_op, call)


def _traced(
    kind: str,
    collective: str,
    nbytes: int,
    group: dist.ProcessGroup | None,
    async_op: bool,
    call: Callable[[], Any],
) -> Any:
    """``call()`` (the collective), a span while a span log records (see the module docstring)."""
    if not spans.active():
        return call()
    size = dist.get_world_size(group)
    link = _active.link_class(group) if _active is not None else f"{size} ranks"
    name = f"{collective} {link}"
    facts: dict[str, Any] = {"link": str(link), "bytes": nbytes, "ranks": size}
    if not async_op:
        with spans.span(name, kind, **facts):
            return call()
    launched = time.perf_counter()
    work = call()
    spans.record(f"launch {name}", "launch", launched, time.perf_counter(), **facts)
    return work if work is None else _TracedWork(work, launched, name, kind, facts)


class _TracedWork:
    """An asynchronous collective's work handle whose ``wait`` records the wait and the time in flight;
    everything else is the handle's own."""

    def __init__(self, work: Any, launched: float, name: str, kind: str, facts: dict[str, Any]) -> None:
        self._work, self._launched, self._name, self._kind, self._facts = work, launched, name, kind, facts

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            end = time.perf_counter()
            spans.record(f"wait {self._name}", "wait", start, end, **self._facts)
            spans.record(self._name, self._kind, self._launched, end, "collectives in flight", **self._facts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# DeepSpeed 0.19 backend methods we count: name -> (kind, collective, the argument whose size is the
# buffer, the parameter names in order). Spelled out because DeepSpeed's decorators hide the signatures.
_DS_METHODS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "all_gather_into_tensor": (
        "gather",
        "all_gather",
        "output_tensor",
        ("output_tensor", "input_tensor", "group", "async_op"),
    ),
    "all_gather": ("gather", "all_gather", "tensor_list", ("tensor_list", "tensor", "group", "async_op")),
    "reduce_scatter_tensor": (
        "reduce",
        "reduce_scatter",
        "input_tensor",
        ("output_tensor", "input_tensor", "op", "group", "async_op"),
    ),
    "reduce_scatter": (
        "reduce",
        "reduce_scatter",
        "input_list",
        ("output", "input_list", "op", "group", "async_op"),
    ),
    "all_reduce": ("other", "all_reduce", "tensor", ("tensor", "op", "group", "async_op")),
    "all_reduce_coalesced": ("other", "all_reduce", "tensors", ("tensors", "op", "group", "async_op")),
    "broadcast": ("other", "broadcast", "tensor", ("tensor", "src", "group", "async_op")),
    "all_to_all_single": (
        "other",
        "all_to_all",
        "input",
        ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    ),
}


def _counted(
    method: Callable[..., Any], kind: str, collective: str, sized: str, names: tuple[str, ...]
) -> Callable[..., Any]:
    signature = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for n in names]
    )

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _active is None and not spans.active():
            return method(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        buffer = arguments[sized]
        nbytes = _nbytes(buffer) if isinstance(buffer, torch.Tensor) else sum(_nbytes(t) for t in buffer)
        group, src = arguments.get("group"), arguments.get("src")  # src: a broadcast's global root
        if _active is not None:
            root = 0 if src is None else group_ranks(group).index(src)
            _active.record(kind, collective, nbytes, group, root)
        call = functools.partial(method, *args, **kwargs)
        return _traced(kind, collective, nbytes, group, bool(arguments.get("async_op")), call)

    return wrapper


def _ag_single(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


def _rs_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: Any = dist.ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


_ABSENT = object()
# The backend object patch_deepspeed_comm changed and the attributes it replaced on it.
_patched: dict[str, Any] = {}


def patch_deepspeed_comm() -> bool:
    """Count DeepSpeed's collectives and route its all-gather/reduce-scatter through the non-deprecated
    torch names. Idempotent; inert (one attribute check per call) while no counter is active.
    Initialises DeepSpeed's communication backend over the existing torch process group if needed.
    Returns whether this call changed anything (False: already patched)."""
    import deepspeed.comm as ds_dist
    from deepspeed.comm import comm as ds_comm

    if ds_comm.cdb is None:
        ds_dist.init_distributed(dist_backend=dist.get_backend())
    cdb = ds_comm.cdb
    assert cdb is not None  # init_distributed made it
    if _patched.get("cdb") is cdb:
        return False
    replaced = ("all_gather_function", "reduce_scatter_function", *_DS_METHODS)
    _patched.update(cdb=cdb, before={name: cdb.__dict__.get(name, _ABSENT) for name in replaced})
    if cdb.has_all_gather_into_tensor():
        cdb.all_gather_function = _ag_single
    if cdb.has_reduce_scatter_tensor():
        cdb.reduce_scatter_function = _rs_single
    for name, (kind, collective, sized, names) in _DS_METHODS.items():
        method = getattr(cdb, name, None)
        if method is None:
            continue
        setattr(cdb, name, _counted(method, kind, collective, sized, names))
    return True


def unpatch_deepspeed_comm() -> None:
    """Undo :func:`patch_deepspeed_comm`: DeepSpeed's backend object as it was before."""
    if not _patched:
        return
    cdb = _patched["cdb"]
    for name, before in _patched["before"].items():
        if before is _ABSENT:
            cdb.__dict__.pop(name, None)
        else:
            setattr(cdb, name, before)
    _patched.clear()
