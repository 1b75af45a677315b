"""A model's parameter shapes before it exists: the constructor run on the meta device.

The hierarchical plan (which secondary level, which hop buffers) depends on the parameters, and the
model must be built under :class:`~.construction.Init` with that plan's groups, so nothing is built whole
on any rank. :func:`spec_on_meta` runs the model's own constructor once with its large tensors on
the meta device (no memory, no random numbers drawn for them) and reads the :class:`ShardSpec`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from deepspeed_ext.zero.cost.volume import ShardSpec
from deepspeed_ext.zero.engine.contract import shard_spec

_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
SMALL = 1024
"""Tensors of fewer elements are made for real: constructors read values such as a per-layer
schedule (``torch.linspace(...)[i].item()``) from small tensors, never from a weight."""


class _LargeTensorsOnMeta(TorchFunctionMode):
    """A factory's result of at least :data:`SMALL` elements goes to the meta device, whatever
    device it names (Megatron names the accelerator's); moving a meta tensor leaves it where it is
    (there is no data to copy), with the dtype asked for."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _MOVES and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return args[0] if dtype is None else torch.empty_like(args[0], dtype=dtype)
        if func in _FACTORIES and "out" not in kwargs:
            shaped = func(*args, **{**kwargs, "device": "meta", "pin_memory": False})
            if shaped.numel() >= SMALL:
                return shaped
        return func(*args, **kwargs)


_FACTORIES = {
    torch.empty,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.rand,
    torch.randn,
    torch.empty_strided,
}


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Every tensor of at least :data:`SMALL` elements made inside is a meta tensor."""
    with _LargeTensorsOnMeta():
        yield


def spec_on_meta(build: Callable[[], torch.nn.Module], ds: dict) -> ShardSpec:
    """This rank's parameters from ``build()`` run with its large tensors on the meta device. Torch's
    RNG states (host, and the devices' once initialised) are restored after, so the real build
    draws what it would draw without this one; ``build`` restores any generator of its own.

    Args:
        build: makes the model.
        ds: the DeepSpeed config (its precision).

    Returns:
        The :class:`ShardSpec` of the model ``build`` makes.
    """
    host = torch.random.get_rng_state()
    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with on_meta():
            model = build()
    finally:
        torch.random.set_rng_state(host)
        if devices is not None:
            torch.cuda.set_rng_state_all(devices)
    return shard_spec(model, ds)
