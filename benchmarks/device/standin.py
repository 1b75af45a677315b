"""The compute stand-in: a dispatch mode that charges a rank's tensor work to a virtual device.

Under :class:`StandIn` every aten op of the rank is one of:

- a collective (``c10d``): run for real once the device has produced its inputs;
- a read of a value (``.item()``, ``equal``): a sync point, computed for real;
- a view or an allocation: run as is;
- an op on host scalars: computed for real;
- anything else: not computed; its output, of the right shape, is charged to the virtual device by
  FLOPs (attention), by FLOPs or bytes plus a fixed tail (GEMMs, :mod:`.gemm_fit`), or by bytes
  moved (the rest, at least one kernel's floor).

A function that stands for one fused kernel (:func:`as_one_kernel`) is charged once for its inputs
and outputs, however many aten ops it takes on the host.

Method in full: benchmarks/results/methods.md, `benchmarks.device.standin`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from benchmarks.device.clock import VirtualDevice

aten = torch.ops.aten
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (
        aten._scaled_dot_product_flash_attention_backward
    ),
}
"""The CPU's fused attention ops, charged with the FLOP formulas of the GPU ops they stand for."""
_SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_ALLOCATION = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
# what an output leaf of a cached op is: the input leaf it returns, a new tensor, or a plain value
_Leaf = tuple[str, Any]


class _Shared:
    """What the modes of one rank's threads share: the device, readiness, the zero buffer."""

    def __init__(self, device: VirtualDevice) -> None:
        self.device = device
        self.ready_of_tensor: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.ready_of_storage: dict[int, float] = {}
        self.zeros = torch.zeros(1 << 20, dtype=torch.uint8).untyped_storage()
        self.outputs: dict[Any, tuple[Any, list[_Leaf]]] = {}


class StandInMode(TorchDispatchMode):
    """The dispatch mode of one thread (see the module docstring); a rank's threads share ``shared``."""

    def __init__(self, shared: _Shared) -> None:
        super().__init__()
        self.shared = shared
        self._fused = 0  # inside as_one_kernel: ops are not charged one by one

    def one_kernel(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)`` charged as one memory-bound kernel: its tensor arguments read and
        its tensor results written once, starting when its inputs are ready."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        after = self._ready(tensors)
        self._fused += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self._fused -= 1
        rate = self.shared.device.table.memory_rate()
        end = self.shared.device.charge(_bytes(tensors, out) / rate, after, "memory")
        self._mark(out, end)
        return out

    @contextlib.contextmanager
    def uncharged(self) -> Iterator[None]:
        """Ops under it are intercepted but charged nothing: building modules, whose initialisation
        writes values no stand-in op reads, so their parameters' pages are never touched."""
        self._fused += 1
        try:
            with self:
                yield
        finally:
            self._fused -= 1

    def for_thread(self) -> StandInMode:
        """A mode for another thread that runs this rank's work (on a stream of its own)."""
        return StandInMode(self.shared)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d":
            return self._collective(func, args, kwargs, tensors)
        if func in _SCALAR_READS:
            self.shared.device.wait_until(self._ready(tensors))
            return func(*args, **kwargs)
        if _is_view(func):
            out = func(*args, **kwargs)
            self._mark(out, self._ready(tensors))
            return out
        if func._overloadpacket in _ALLOCATION:
            return func(*args, **kwargs)
        try:
            out_spec, out_leaves = self._outputs(func, leaves, spec)
        except Exception:  # no meta kernel, or an output shape that depends on values: a sync point
            after = self._ready(tensors)
            self.shared.device.wait_until(after)
            out = func(*args, **kwargs)
            self._mark(out, self._charge(func, args, kwargs, tensors, out, after))
            return out
        made = [t for kind, t in out_leaves if kind == "new"]
        if all(t.numel() <= 1 for t in tensors) and all(math.prod(t[0]) <= 1 for t in made):
            return func(*args, **kwargs)  # host scalars, computed for real
        after = self._ready(tensors)
        out = tree_unflatten([self._leaf(kind, value, leaves) for kind, value in out_leaves], out_spec)
        self._mark(out, self._charge(func, args, kwargs, tensors, out, after))
        return out

    def _outputs(self, func: Any, leaves: list[Any], spec: Any) -> tuple[Any, list[_Leaf]]:
        """The output's structure and leaves, from the op's meta kernel (cached per input layout)."""
        key_leaves = tuple(
            (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves
        )
        try:
            key: Any = (func, spec, key_leaves)
            hash(key)
        except TypeError:
            key = None
        cached = self.shared.outputs.get(key) if key is not None else None
        if cached is not None:
            return cached
        meta = [
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            if isinstance(x, torch.Tensor)
            else torch.device("meta")
            if isinstance(x, torch.device)
            else x
            for x in leaves
        ]
        meta_args, meta_kwargs = tree_unflatten(meta, spec)
        if "device" in meta_kwargs:
            meta_kwargs["device"] = torch.device("meta")
        out = func(*meta_args, **meta_kwargs)
        position = {id(m): i for i, m in enumerate(meta) if isinstance(m, torch.Tensor)}
        out_leaves, out_spec = tree_flatten(out)
        described: list[_Leaf] = []
        for leaf in out_leaves:
            if not isinstance(leaf, torch.Tensor):
                described.append(("value", leaf))
            elif id(leaf) in position:
                described.append(("input", position[id(leaf)]))
            else:
                described.append(("new", (tuple(leaf.shape), leaf.stride(), leaf.dtype)))
        if key is not None:
            self.shared.outputs[key] = (out_spec, described)
        return out_spec, described

    def _leaf(self, kind: str, value: Any, leaves: list[Any]) -> Any:
        if kind == "input":
            return leaves[value]
        if kind == "value":
            return value
        shape, stride, dtype = value
        if math.prod(shape) <= 1:  # its own storage: host scalar ops may write it
            return torch.zeros(shape, dtype=dtype).as_strided(shape, stride)
        span = 1 + sum((size - 1) * step for size, step in zip(shape, stride) if size > 0)
        nbytes = span * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.shared.zeros.nbytes():
            size = 1 << math.ceil(math.log2(nbytes))
            self.shared.zeros = torch.zeros(size, dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(self.shared.zeros, 0, shape, stride)

    def _charge(
        self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor], out: Any, after: float
    ) -> float:
        """Queue the op's duration on this thread's stream; returns when it ends (inside a fused
        kernel: nothing queued, ready when its inputs are)."""
        if self._fused:
            return after
        table = self.shared.device.table
        packet = ATTENTION.get(func, func._overloadpacket)
        formula = flop_registry.get(packet)
        if func._overloadpacket is aten.embedding:  # reads the rows it returns, not the table
            tensors = tensors[1:]
        moved = _bytes(tensors, out)
        if formula is None:
            return self.shared.device.charge(moved / table.memory_rate(), after, "memory")
        flops = formula(*args, **kwargs, out_val=out)  # torch's formula reads the shapes
        if func not in ATTENTION:
            return self.shared.device.charge(
                table.gemm_seconds(flops, moved, tensors[0].dtype), after, "matmul"
            )
        if _argument(func, args, kwargs, "is_causal"):
            flops /= 2  # fused causal attention skips the masked half
        seconds = flops / (table.matmul_peak(tensors[0].dtype) * table.attention_efficiency)
        return self.shared.device.charge(seconds, after, "attention")

    def _collective(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        device = self.shared.device
        device.wait_until(self._ready(tensors))
        zero = self.shared.zeros.data_ptr()

        def writable(x: Any) -> Any:
            # a collective writes real values: never into the shared zero buffer, but into a fresh
            # buffer (uninitialised: its values are as unread as every device op's)
            if isinstance(x, torch.Tensor) and x.numel() > 1 and x.untyped_storage().data_ptr() == zero:
                return torch.empty_like(x)
            return x

        out = func(*tree_map(writable, args), **tree_map(writable, kwargs))
        # A blocking call's caller waits at once: nothing of this thread runs beside it. (Its work
        # may never report completion: gloo's reduce-scatter does not, even once waited on.)
        if any(a.name == "async_op" for a in func._schema.arguments) and not _argument(
            func, args, kwargs, "async_op"
        ):
            return out
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.ScriptObject):  # the op's work handle, boxed
                device.collective_started(torch._C._distributed_c10d.Work.unbox(item))
        return out

    def _ready(self, tensors: list[torch.Tensor]) -> float:
        """When the last device op that wrote any of ``tensors`` ends (0: none pending)."""
        zero, last = self.shared.zeros.data_ptr(), 0.0
        for t in tensors:
            last = max(last, self.shared.ready_of_tensor.get(t, 0.0))
            ptr = t.untyped_storage().data_ptr()
            if ptr != zero:
                last = max(last, self.shared.ready_of_storage.get(ptr, 0.0))
        return last

    def _mark(self, out: Any, when: float) -> None:
        if when <= time.perf_counter():
            return
        zero = self.shared.zeros.data_ptr()
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shared.ready_of_tensor[t] = when
                ptr = t.untyped_storage().data_ptr()
                if ptr != zero:
                    self.shared.ready_of_storage[ptr] = when


def _bytes(inputs: list[torch.Tensor], out: Any) -> int:
    """Bytes a kernel reads (``inputs``) and writes (the tensors of ``out``)."""
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in (*inputs, *outs))


@functools.cache
def _is_view(func: Any) -> bool:
    """Ops whose outputs alias an input without writing it (view, reshape, transpose, detach)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The value of argument ``name`` of a call of ``func`` (its default when not passed)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            return args[i] if i < len(args) else argument.default_value
    raise KeyError(name)


def as_one_kernel(fn: Any) -> Any:
    """``fn`` as one fused kernel under a rank's stand-in (:meth:`StandInMode.one_kernel`); as is
    elsewhere. For pure-torch stand-ins of a library's fused kernels."""

    @functools.wraps(fn)
    def one(*args: Any, **kwargs: Any) -> Any:
        mode = next(
            (m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, StandInMode)), None
        )
        return fn(*args, **kwargs) if mode is None else mode.one_kernel(fn, args, kwargs)

    return one
