"""A LayerNorm / RMSNorm that megatron-core layer specs can build, also with sequence parallelism.

megatron-core's torch fallback norm refuses sequence parallelism because, with the sequence split
over TP ranks, each rank's norm weight sees only its slice: the weight gradients must be summed
over the TP group. We mark the parameters ``sequence_parallel`` (megatron-core's convention) and
:func:`megatron_ext.layers.sequence_parallel.allreduce_sequence_parallel_grads` sums them.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SequenceParallelNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` per ``config.normalization``."""

    def __new__(  # type: ignore[misc]  # a factory: it returns a torch norm
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: object
    ) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported: use LayerNorm or RMSNorm"
            )
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm: disable it")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron-core's marker
        return norm
