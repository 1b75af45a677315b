"""The autograd context, typed: torch passes every ``Function`` its ``ctx`` untyped, and each of the
layers' functions keeps its own attributes on it (a Protocol per function names them)."""

from __future__ import annotations

from typing import Protocol

import torch


class SavingContext(Protocol):
    """What torch's ``FunctionCtx`` offers forward and backward alike."""

    @property
    def saved_tensors(self) -> tuple[torch.Tensor, ...]: ...

    @property
    def needs_input_grad(self) -> tuple[bool, ...]: ...

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...
