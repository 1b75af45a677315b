"""What megatron-core 0.16 needs to run a GPTModel on CPU with gloo (tests, the local demo).

Two things assume CUDA: buffers placed with ``torch.cuda.current_device()`` (the global memory
buffer used by sequence-parallel gathers) and the model-parallel RNG tracker, which saves and
restores CUDA generator states. On a machine without CUDA we point the first at the CPU and back
the tracker with the CPU generator. With CUDA present nothing is touched. Every change is recorded
and :func:`disable_cpu_support` puts the original objects back.
"""

from __future__ import annotations

import torch

_undo: list[tuple[object, str, object]] = []  # (owner, attribute, original), in order of change


def _cpu_get_rng_state(
    device: object = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CPU twin of ``CudaRNGStatesTracker.add``: a named generator state seeded with ``seed``."""
    if seed in self.seeds_:
        raise RuntimeError(f"RNG seed {seed} is already tracked")
    if name in self.states_:
        raise RuntimeError(f"RNG state {name!r} is already tracked")
    self._is_initialized = True
    self.seeds_.add(seed)
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


def enable_cpu_support() -> bool:
    """Patch megatron-core for CPU when CUDA is absent; returns whether the patches are in place."""
    if torch.cuda.is_available():
        return False
    if _undo:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    for owner, name, value in (
        (
            torch.cuda,
            "current_device",
            lambda: "cpu",
        ),  # device ids flow straight into torch.empty(device=...)
        (mp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
        (mp_random.CudaRNGStatesTracker, "add", _tracker_add),
    ):
        _undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)
    return True


def disable_cpu_support() -> None:
    """Undo :func:`enable_cpu_support` (nothing to do when it changed nothing)."""
    while _undo:
        owner, name, original = _undo.pop()
        setattr(owner, name, original)


def cpu_support_enabled() -> bool:
    """Whether :func:`enable_cpu_support` has patched megatron-core in this process."""
    return bool(_undo)
