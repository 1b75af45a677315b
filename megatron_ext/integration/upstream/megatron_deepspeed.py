"""The hooks upstream Megatron-DeepSpeed (commit 4efb479) calls through
``patches/megatron-deepspeed-4efb479.patch``: the plugin flags, the shared-memory loader's data
iterators and batches, hierarchical ZeRO-3 in place of ``deepspeed.zero.Init`` /
``deepspeed.initialize``, Ulysses attention (the stock call fixed for DeepSpeed 0.19, and
Flash-Overlap's overlapped all-to-alls with ``--flash-overlap``), and Flash-Overlap's TP/SP
linears (:mod:`megatron_ext.integration.upstream.ds_linears`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from mdsp_base.section import ConfigError
from megatron_ext.integration.upstream.ds_linears import overlap_linears
from megatron_ext.integration.upstream.ds_parallelism import (
    sequence_parallel_under_deepspeed,
    ulysses_clipping_notice,
)
from megatron_ext.integration.upstream.ds_zero_init import hierarchical_zero_init
from megatron_ext.integration.upstream.hooks import (
    HIERARCHICAL_ZERO_NEEDS_MEGATRON_GROUPS,
    external_data_iterators,
    installer,
    is_plugin_iterator,
    megatron_args,
    own_iterators,
    own_posters,
    plugin_config,
    shm_loader_enabled,
    with_plugin_args,
)

__all__ = [
    "TextSamples",
    "data_iterators",
    "deepspeed_initialize",
    "overlap_linears",
    "per_head_attention",
    "shm_loader_enabled",
    "text_batch",
    "ulysses_context",
    "ulysses_overlap",
    "with_plugin_args",
    "zero_init",
]  # what the patch names

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _TextSampleConfig:
    """The fields of a megatron-core GPTDatasetConfig that the loader reads."""

    sequence_length: int
    add_extra_token_to_sequence: bool = True
    reset_attention_mask: bool = False


class TextSamples:
    """A Megatron-DeepSpeed dataset (items ``{"text": int64[seq_length + 1]}``) seen as megatron-core
    GPTDataset items: tokens, labels, loss_mask and position_ids. Megatron-DeepSpeed's ``get_batch``
    rebuilds ``text`` from tokens and labels (:func:`text_batch`) and computes its masks itself."""

    def __init__(self, dataset: Any, seq_length: int) -> None:
        self.samples = dataset
        self.config = _TextSampleConfig(seq_length)

    def __len__(self) -> int:
        return len(self.samples)

    def _query_document_sample_shuffle_indices(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        """The sample's ``seq_length + 1`` ids (and no document ids), named as GPTDataset names its
        reader: the node loader reads samples through it."""
        text = np.asarray(self.samples[idx]["text"], dtype=np.int64)
        seq = self.config.sequence_length
        if text.shape != (seq + 1,):
            raise ValueError(
                f"sample {idx} has {tuple(text.shape)} tokens, expected ({seq + 1},) for --seq-length "
                f"{seq}: rebuild the dataset index for this sequence length"
            )
        return text, np.empty(0, dtype=np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self._query_document_sample_shuffle_indices(idx)[0])
        seq = self.config.sequence_length
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": torch.ones(seq, dtype=torch.float32),
            "position_ids": torch.arange(seq),
        }


def data_iterators(provider: Callable[..., Any]) -> tuple[Any, ...]:
    """Megatron-DeepSpeed's ``build_train_valid_test_data_iterators`` with the shared-memory loader:
    datasets on every rank, plugin iterators over them, and the do_train/valid/test flags set."""
    from megatron.core import parallel_state as mpu
    from megatron.training import build_train_valid_test_datasets

    args = megatron_args()
    if args.iteration > 0 and args.consumed_train_samples == 0:  # checkpoints that predate the counter
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.train_samples is None:
        args.consumed_valid_samples = (
            (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
        )
    # Upstream builds on TP rank 0 only, and its index maps are written by rank 0 and awaited within the
    # data-parallel group: those ranks go first, the others then find the maps written.
    first = mpu.get_tensor_model_parallel_rank() == 0
    built: Any = build_train_valid_test_datasets(provider) if first else None
    dist.barrier()
    built = built if first else build_train_valid_test_datasets(provider)
    datasets = [None if d is None else TextSamples(d, args.seq_length) for d in built]
    iterators = external_data_iterators(datasets, args)
    own_iterators(iterators)
    args.do_train = iterators[0] is not None and args.train_iters > 0
    args.do_valid = iterators[1] is not None and args.eval_iters > 0
    args.do_test = iterators[2] is not None and args.eval_iters > 0
    return iterators


def text_batch(keys: Sequence[str], data_iterator: Any, datatype: torch.dtype) -> dict[str, torch.Tensor]:
    """What Megatron-DeepSpeed's ``get_batch`` gets from ``tensor_parallel.broadcast_data``: the
    ``text`` rows. From a plugin iterator every rank reads its own; otherwise TP rank 0 reads and broadcasts."""
    if not is_plugin_iterator(data_iterator):
        from megatron.core import tensor_parallel

        data = next(data_iterator) if data_iterator is not None else None
        return tensor_parallel.broadcast_data(keys, data, datatype)
    if list(keys) != ["text"]:
        raise ValueError(f"the plugin loader provides the 'text' key only, get_batch asked for {list(keys)}")
    batch = next(data_iterator)
    return {"text": torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1).to(datatype)}


def zero_init(**kwargs: Any) -> Any:
    """``deepspeed.zero.Init(**kwargs)``; with hierarchical ZeRO ours, partitioned over the level
    groups from construction (:mod:`megatron_ext.integration.upstream.ds_zero_init`)."""
    import deepspeed

    if plugin_config().hierarchical_zero.enabled and kwargs.get("enabled", True):
        return hierarchical_zero_init(kwargs)
    return deepspeed.zero.Init(**kwargs)


def deepspeed_initialize(**kwargs: Any) -> tuple:
    """``deepspeed.initialize(**kwargs)`` through ``deepspeed_ext.zero.initialize`` (the hierarchical
    ZeRO-3 variant when it is enabled), the engine destroyed when the run's installer closes; with
    ``--sequence-parallel``, checked and given the TP gradient sums DeepSpeed leaves out."""
    from deepspeed_ext.zero import initialize

    sequence_parallel_under_deepspeed(kwargs["model"])
    args = megatron_args()
    ds = getattr(args, "deepspeed_config_dict", None) or {}
    config = plugin_config()
    notice = ulysses_clipping_notice(
        getattr(args, "ds_sequence_parallel_size", 1),
        float(ds.get("gradient_clipping", 1.0)),  # DeepSpeed's default
        int((ds.get("zero_optimization") or {}).get("stage", 0)),
        config.hierarchical_zero.enabled and config.hierarchical_zero.sequence_parallel_gradients == "mean",
    )
    if notice and dist.get_rank() == 0:
        logger.warning(notice)
    if config.hierarchical_zero.enabled and kwargs.get("mpu") is None:
        raise ConfigError(HIERARCHICAL_ZERO_NEEDS_MEGATRON_GROUPS)
    # The plan zero_init made is found by the model's partition: this call cannot carry it.
    return initialize(plugin_config=config, installer=installer(), **kwargs)


# -- Ulysses sequence parallelism (--ds-sequence-parallel-size) ------------------------------------
class _PerHeadContext(torch.nn.Module):
    """Megatron-DeepSpeed's local attention as DeepSpeed 0.19's ``DistributedAttention`` needs it: its
    reverse all-to-all takes the context as [s, b, heads, d], and CoreAttention returns [s, b, heads * d]."""

    def __init__(self, attention: torch.nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        return self.attention(query, key, value, *args).view(*query.shape[:-1], -1)


def per_head_attention(local_attention: torch.nn.Module) -> torch.nn.Module:
    """The local attention the patched ``ParallelAttention`` hands to ``DistributedAttention``."""
    return _PerHeadContext(local_attention)


def split_qkv(attention: Any, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron-DeepSpeed's fused QKV output without Ulysses, [s, b, (heads + 2 kv_heads) * d] of
    this tensor-parallel rank, as q [s, b, heads, d] and k, v [s, b, kv_heads, d] (its [q | k | v]
    layout). Upstream cuts it in thirds, which holds only without grouped-query attention
    (``--num-key-value-heads`` < heads fails with "shape '[64, 1, -1, 16]' is invalid").

    Each part is made contiguous: a cut of the last dimension is a strided view, and the tree's
    ``CoreAttention`` merges its batch and head dimensions with ``view``, which such a view allows
    only at micro-batch 1 ("view size is not compatible with input tensor's size and stride")."""
    d = attention.head_dim
    q = attention.num_attention_heads_per_partition * d
    kv = attention.num_key_value_heads_per_partition * d
    s, b = mixed.shape[:2]
    return cast(
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        tuple(part.reshape(s, b, -1, d).contiguous() for part in torch.split(mixed, [q, kv, kv], dim=-1)),
    )


def ulysses_context(dist_attn: Any, query: Any, key: Any, value: Any, attention_mask: Any) -> torch.Tensor:
    """Stock Ulysses on the non-flash path, called as DeepSpeed 0.19 defines it: upstream passes the
    mask where ``DistributedAttention`` takes ``batch_dim_idx`` (Megatron's layout is [s, b, ...]: 1)."""
    return dist_attn(query, key, value, 1, None, attention_mask).flatten(2)


def _repeating_kv(local: Callable[..., torch.Tensor], attention: Any) -> Callable[..., torch.Tensor]:
    """``local`` attention for grouped-query attention: k and v cross the all-to-all unrepeated,
    and each rank repeats its own key/value heads for their query heads with the module's
    ``repeat_kv``, as upstream does at SP=1."""
    groups = attention.num_key_value_groups

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor:
        return local(q, attention.repeat_kv(k, groups), attention.repeat_kv(v, groups), *rest)

    return attend


def _flash(attention: Any) -> Callable[..., torch.Tensor]:
    """The module's flash attention as the block's local attention: (q, k, v [s, b, heads, d], mask)
    -> context [s, b, heads * d]. Both flash modules are causal by construction and take no mask,
    as upstream calls them: ``FlashSelfAttention`` (v1, v2, the op builder's) takes and returns
    [b, s, heads, d]; ``FlashSelfAttentionTriton`` takes [s, b, heads, d] and returns
    [s, b, heads * d]. Called without an RNG-tracker fork, as ``DistributedAttention`` calls it."""
    flash = attention.dist_attn.local_attn.attention  # inside per_head_attention's wrapper
    if attention.use_flash_attn_triton:
        return lambda q, k, v, *mask: flash(q, k, v)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: Any) -> torch.Tensor:
        batch_major = [t.transpose(0, 1).contiguous() for t in (q, k, v)]
        return flash(*batch_major).transpose(0, 1).flatten(2)

    return attend


def _rotating(local: Callable[..., torch.Tensor], rotary_pos_emb: Any) -> Callable[..., torch.Tensor]:
    """``local`` attention with rotary embeddings applied to q and k over the whole sequence (after
    the all-to-all, where each rank holds every position of its heads), by the tree's own
    ``apply_rotary_pos_emb`` with the embeddings ``ParallelAttention`` gets, as upstream applies
    them at SP=1."""
    from megatron.model.rotary_pos_embedding import apply_rotary_pos_emb

    q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> torch.Tensor:
        return local(apply_rotary_pos_emb(q, q_emb), apply_rotary_pos_emb(k, k_emb), v, *rest)

    return attend


def ulysses_overlap(attention: Any) -> Callable[..., tuple[torch.Tensor, Any]] | None:
    """Flash-Overlap's UP forward for a Megatron-DeepSpeed ``ParallelAttention`` that runs Ulysses
    (``--ds-sequence-parallel-size`` > 1 with ``--flash-overlap``), or None to run upstream's. It
    uses the module's own ``query_key_value`` and ``dense`` weights (under ZeRO-3 registered as the
    attention module's external parameters, so DeepSpeed gathers them for its forward and backward)
    and returns the output with the dense bias added (bias None), which upstream's bias-dropout-add
    computes alike; ``--drop-path-rate`` (which needs the bias apart) is refused."""
    overlap = plugin_config().flash_overlap
    if not overlap.enabled:
        return None
    if not getattr(attention, "enable_ds_sequence_parallel", False):
        return None  # the TP/SP linears, if any: ds_linears.overlap_linears
    import deepspeed
    from megatron.core import parallel_state

    from megatron_ext.layers.p2p.link import Mode, OverlapGroup, check_nccl_waits, run_device
    from megatron_ext.layers.ulysses import HeadSplit, check_sequence_length, ulysses_attention

    args = megatron_args()
    own_posters()
    group = parallel_state.get_sequence_parallel_group()
    split = HeadSplit(
        attention.num_attention_heads, attention.num_key_value_heads, attention.head_dim, group.size()
    )
    check_sequence_length(args.seq_length, group.size())
    og = OverlapGroup(
        group,
        Mode.DIRECT,
        overlap.timeout_s,
        f"ulysses attention {attention.layer_number}",
    )
    qkv, dense = attention.query_key_value, attention.dense
    check_nccl_waits(og, run_device(dense.weight))
    for param in (qkv.weight, qkv.bias, dense.weight, dense.bias):
        if param is not None and hasattr(param, "ds_id"):  # partitioned by ZeRO-3's zero.Init
            deepspeed.zero.register_external_parameter(attention, param)
    local = _flash(attention) if attention.use_flash_attn else attention.dist_attn.local_attn
    if attention.use_gqa:
        local = _repeating_kv(local, attention)
    if attention.layer_number == 1:
        logger.info(
            "flash_overlap: Ulysses attention with overlapped all-to-alls over %d ranks", group.size()
        )
    if getattr(args, "drop_path_rate", 0.0) > 0:
        raise ConfigError(
            "flash_overlap's Ulysses attention adds the output bias itself: drop --drop-path-rate"
        )

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: Any,
        inference_params: Any = None,
        rotary_pos_emb: Any = None,
    ) -> tuple[torch.Tensor, Any]:
        if inference_params is not None:
            raise ConfigError(
                "flash_overlap's Ulysses attention covers training: drop --flash-overlap for inference"
            )
        attend = local if rotary_pos_emb is None else _rotating(local, rotary_pos_emb)
        out = ulysses_attention(
            hidden_states, qkv.weight, qkv.bias, dense.weight, attend, split, og, attention_mask
        )
        # The bias is added here, where ZeRO-3 has gathered it (a partitioned bias handed out of this
        # forward would be released with the module); the layer's bias-dropout-add takes None.
        return (out if dense.bias is None else out + dense.bias), None

    return forward
