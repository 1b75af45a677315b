"""The tiny megatron-core GPT the tests build: two layers of four heads, seeded as the main job
seeds a model (torch's generator and Megatron's model-parallel RNG tracker)."""

from __future__ import annotations

from typing import Any

import torch


def seeded_gpt(
    seed: int,
    *,
    hidden: int,
    vocab: int,
    seq: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    ffn: int | None = None,
    layer_spec: Any = None,
) -> torch.nn.Module:
    """``megatron_ext.integration.gpt.build_gpt_model`` of a 2-layer, 4-head GPT after seeding both RNGs."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.integration.gpt import build_gpt_model, gpt_config

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = gpt_config(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=4,
        ffn_hidden_size=ffn,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
    )
    return build_gpt_model(config, vocab, seq, layer_spec)
