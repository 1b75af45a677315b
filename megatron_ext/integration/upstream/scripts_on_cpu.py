"""What upstream Megatron-LM (core_v0.16.1) and Megatron-DeepSpeed (4efb479) need to train on a machine
without CUDA (gloo, CPU).

``python -m megatron_ext.launch`` calls :func:`enable` before it runs an upstream Megatron-LM
``pretrain_gpt.py`` and :func:`disable` after it; where CUDA exists :func:`enable` changes nothing.
Upstream assumes CUDA in places that have no switch: on CPU each is mapped to its CPU twin, here in
one module, and every change is recorded so that :func:`disable` restores the original object. For
Megatron-DeepSpeed :func:`enable_megatron_deepspeed` changes one thing. Each change and why:
docs/integration.md, "Without CUDA"."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

ENV_DEFAULTS = {"TORCH_COMPILE_DISABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
_CUDA_TO_CPU = ("device_count", "set_device", "synchronize", "Stream", "Event", "current_stream", "stream")

_undo: list[Callable[[], object]] = []  # in order of application; disable() runs them backwards
_mode: CudaToCpu | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _to_cpu(value: Any) -> Any:
    return torch.device("cpu") if _is_cuda(value) else value


class CudaToCpu(TorchFunctionMode):
    """Runs every torch call that names the CUDA device on the CPU instead.

    It must live in an importable module (not the script's ``__main__``): torch looks modes up by
    class when it re-enters them."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # .cuda() returns the tensor itself when it is already on the target device.
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_to_cpu(a) for a in args)
        return func(*args, **kwargs)


def _replace(owner: Any, name: str, value: Any) -> None:
    original = getattr(owner, name)
    setattr(owner, name, value)
    _undo.append(lambda: setattr(owner, name, original))


def _set_env_default(name: str, value: str) -> None:
    if name in os.environ:
        return
    os.environ[name] = value
    _undo.append(lambda: os.environ.pop(name, None))


def _twin(cpu_object: Any) -> Any:
    """A new object that behaves as ``cpu_object``: torch.compile's tables refuse one object listed
    both under torch.cpu and torch.cuda."""
    if isinstance(cpu_object, type):
        return type(cpu_object.__name__, (cpu_object,), {"__module__": __name__})

    @functools.wraps(cpu_object)
    def twin(*args: Any, **kwargs: Any) -> Any:
        return cpu_object(*args, **kwargs)

    return twin


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _no_fused_kernels(args: Any) -> None:
    """Megatron-LM's fused kernels are CUDA code: on CPU there is nothing to compile or load, and the
    unfused paths run instead (upstream falls back to them whenever the kernels do not apply)."""
    logger.info("no CUDA: Megatron-LM's fused CUDA kernels are not compiled")


def _no_gpu_architecture() -> int:
    return 0


def _allow_no_cuda(initialize_megatron: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize_megatron)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return wrapper


def _megatron_lm_modules() -> dict[str, Any]:
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training as training_pkg
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import megatron.training.training as training
    import megatron.training.utils as utils

    return {
        "fused_kernels": fused_kernels,
        "training_pkg": training_pkg,
        "arguments": arguments,
        "initialize": initialize,
        "training": training,
        "utils": utils,
    }


def enable() -> bool:
    """Map upstream Megatron-LM's CUDA assumptions to the CPU when CUDA is absent; returns whether
    anything changed. Megatron-LM must be importable (its checkout first on ``sys.path``)."""
    global _mode
    if torch.cuda.is_available():
        return False
    if _mode is not None:
        return True
    for name, value in ENV_DEFAULTS.items():
        _set_env_default(name, value)
    if "torch._dynamo.config" in sys.modules:  # imported before the variable was set
        _replace(sys.modules["torch._dynamo.config"], "disable", True)
    for name in _CUDA_TO_CPU:
        _replace(torch.cuda, name, _twin(getattr(torch.cpu, name)))
    _replace(torch.cuda, "get_rng_state", _cpu_rng_state)
    _replace(torch.cuda, "set_rng_state", _set_cpu_rng_state)
    from megatron_ext.integration import core_on_cpu as cpu

    if not cpu.cpu_support_enabled() and cpu.enable_cpu_support():
        _undo.append(cpu.disable_cpu_support)
    modules = _megatron_lm_modules()
    _replace(modules["fused_kernels"], "load", _no_fused_kernels)
    for key in ("utils", "arguments"):
        _replace(modules[key], "get_device_arch_version", _no_gpu_architecture)
    wrapped = _allow_no_cuda(modules["initialize"].initialize_megatron)
    for key in ("initialize", "training_pkg", "training"):  # each holds its own reference
        _replace(modules[key], "initialize_megatron", wrapped)
    _mode = CudaToCpu()
    _mode.__enter__()
    logger.info(
        "no CUDA: upstream Megatron-LM runs on CPU (megatron_ext.integration.upstream.scripts_on_cpu)"
    )
    return True


def disable() -> None:
    """Undo :func:`enable`, :func:`megatron_ext.integration.core_on_cpu.enable_cpu_support` included when it turned it on."""
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None
    while _undo:
        _undo.pop()()


def enabled() -> bool:
    """Whether :func:`enable` or :func:`enable_megatron_deepspeed` has changed this process."""
    return _mode is not None or bool(_undo)


def _gather_by_element_count(all_gather_into_tensor: Callable[..., Any]) -> Callable[..., Any]:
    """``all_gather_into_tensor`` that takes an output of any shape holding world x the input's
    elements, as NCCL does; gloo requires [world * rows, ...] of the input's row shape."""

    @functools.wraps(all_gather_into_tensor)
    def gather(
        output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        out, inp = output_tensor, input_tensor
        chunk_shaped = out.dim() == inp.dim() and out.shape[1:] == inp.shape[1:]
        if (
            chunk_shaped
            or out.numel() != torch.distributed.get_world_size(group) * inp.numel()
            or not out.is_contiguous()
        ):
            return all_gather_into_tensor(out, inp, group=group, async_op=async_op)
        return all_gather_into_tensor(out.view(-1), inp.reshape(-1), group=group, async_op=async_op)

    return gather


def enable_megatron_deepspeed() -> bool:
    """What upstream Megatron-DeepSpeed (4efb479) needs on gloo, when CUDA is absent: its Ulysses loss
    (``vocab_sequence_parallel_cross_entropy``) gathers [s/n * b] losses into an [s, b] tensor with
    ``all_gather_into_tensor``, which NCCL takes by element count and gloo refuses ("invalid tensor
    size"); the gather is made to flatten such shapes. Returns whether anything changed; undone by
    :func:`disable`."""
    if torch.cuda.is_available():
        return False
    if not _undo:
        _replace(
            torch.distributed,
            "all_gather_into_tensor",
            _gather_by_element_count(torch.distributed.all_gather_into_tensor),
        )
        logger.info(
            "no CUDA: all_gather_into_tensor takes outputs by element count, as on NCCL (megatron_ext.integration.upstream.scripts_on_cpu)"
        )
    return True
