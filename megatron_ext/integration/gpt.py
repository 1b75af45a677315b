"""Building a megatron-core GPTModel with the suite's layer specs, and its language-model loss."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.layers.norm import SequenceParallelNorm
from megatron_ext.layers.spec import local_layer_spec


def gpt_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    tensor_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    bf16: bool = False,
    ffn_hidden_size: int | None = None,
    dropout: float = 0.0,
    init_method_std: float = 0.02,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
) -> TransformerConfig:
    """A TransformerConfig for GPT; CPU initialisation when there is no GPU, so that weights do not
    depend on the TP size (the master weight is built whole and sliced). The recompute settings are
    Megatron's (``--recompute-granularity`` and its companions)."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=sequence_parallel and tensor_model_parallel_size > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        init_method_std=init_method_std,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
    )


def build_gpt_model(
    config: TransformerConfig, vocab_size: int, seq_length: int, layer_spec: ModuleSpec | None = None
) -> GPTModel:
    """GPTModel whose layers follow ``layer_spec`` (default :func:`local_layer_spec`) and whose final
    norm is the SP-capable one (megatron-core picks its own final norm when given a layer spec)."""
    layer_spec = layer_spec or local_layer_spec()
    block = TransformerBlockSubmodules(
        layer_specs=[layer_spec] * config.num_layers, layer_norm=SequenceParallelNorm
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )


def causal_mask(seq_length: int, device: torch.device | str) -> torch.Tensor:
    """Boolean mask [1, 1, s, s], True where attention is NOT allowed (megatron-core's convention);
    passed explicitly because megatron-core's default is built on CUDA."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1)[None, None]


def gpt_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over the tokens that ``loss_mask`` keeps."""
    tokens = batch["tokens"]
    mask = batch.get("attention_mask")
    if mask is None:
        mask = causal_mask(tokens.shape[1], tokens.device)
    per_token = model(tokens, batch["position_ids"], mask, labels=batch["labels"])
    loss_mask = batch["loss_mask"].to(per_token.dtype)
    return (per_token * loss_mask).sum() / loss_mask.sum().clamp(min=1)


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding: a multiple of ``divisible_by * TP`` so every TP shard is equal."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple
