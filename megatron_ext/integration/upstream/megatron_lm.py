"""The hooks upstream Megatron-LM (tag core_v0.16.1) calls: its ``pretrain_gpt.py`` through
``patches/megatron-lm-core_v0.16.1.patch``, its ``--spec`` through the two blocks at the end.

* Flags: :func:`with_plugin_args` is the ``extra_args_provider`` given to ``pretrain()``.
* Data: :class:`DatasetsProvider` wraps ``train_valid_test_datasets_provider``; with the
  shared-memory loader on it returns this rank's batch iterators, and
  :func:`get_batch_on_this_tp_rank` takes every rank's batch from its own (no TP broadcast).
* Model: ``--spec megatron_ext.integration.upstream.megatron_lm flash_overlap_layer_spec`` (or
  ``local_layer_spec``), built by :mod:`megatron_ext.integration.upstream.layer_specs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mdsp_base.section import ConfigError
from megatron_ext.integration.upstream.hooks import (
    LOCAL_SPEC_ATTRIBUTE,
    SPEC_ATTRIBUTE,
    SPEC_FLAG,
    external_data_iterators,
    is_plugin_iterator,
    megatron_args,
    own_iterators,
    own_posters,
    plugin_config,
    shm_loader_enabled,
    with_plugin_args,
)

__all__ = [
    "DatasetsProvider",
    "get_batch_on_this_tp_rank",
    "shm_loader_enabled",
    "with_plugin_args",
    "flash_overlap_layer_spec",
    "local_layer_spec",
]  # what the patch and --spec name

_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
_PACKED_KEYS = ("cu_seqlens", "max_seqlen", "local_cp_size")  # packed sequences: never produced by our loader


class DatasetsProvider:
    """Megatron-LM's ``train_valid_test_datasets_provider`` wrapped for the shared-memory loader.

    Loader off: the wrapped provider's datasets, untouched. Loader on: it builds the datasets (on
    every rank) and returns :func:`external_data_iterators` over them; it then sets
    ``args.dataloader_type`` to ``external``, because Megatron-LM reads that setting after the provider
    returns and only ``external`` passes the iterators through (the chosen order stays the one
    single/cyclic gave)."""

    def __init__(self, provider: Callable[..., Any]) -> None:
        self._provider = provider

    @property
    def is_distributed(self) -> bool:
        """Megatron-LM calls a distributed provider on every rank, as the loader needs."""
        return bool(getattr(self._provider, "is_distributed", False)) or shm_loader_enabled()

    def __call__(self, train_val_test_num_samples: Sequence[int], vp_stage: int | None = None) -> Any:
        kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
        datasets = self._provider(train_val_test_num_samples, **kwargs)
        args = megatron_args()
        if not plugin_config(args).shm_data_loader.enabled:
            return datasets
        iterators = external_data_iterators(datasets, args)
        own_iterators(iterators)
        args.dataloader_type = "external"
        return iterators


def get_batch_on_this_tp_rank(data_iterator: Any, mtp_on_this_rank: bool = False) -> dict[str, Any]:
    """Megatron-LM's ``get_batch_on_this_tp_rank`` for the plugin iterators: every rank takes its
    micro-batch from its own iterator (the node's ring, or the stock path, which broadcasts inside
    ``next``). Any other iterator (or None) goes to Megatron-LM's own function."""
    if not is_plugin_iterator(data_iterator):
        from megatron.training.utils import get_batch_on_this_tp_rank as upstream

        return upstream(data_iterator, mtp_on_this_rank=mtp_on_this_rank)
    batch = next(data_iterator)
    return {key: batch.get(key) for key in _BATCH_KEYS + _PACKED_KEYS}


# -- model (Megatron-LM --spec) -------------------------------------------------------------------


def _spec(name: str) -> Any:
    """The block behind ``--spec megatron_ext.integration.upstream.megatron_lm <name>``, built from the parsed flags."""
    from megatron_ext.integration.upstream.layer_specs import block_spec

    args = megatron_args()
    overlap = None
    if name == SPEC_ATTRIBUTE:
        overlap = plugin_config(args).flash_overlap
        if not overlap.enabled:
            raise ConfigError(
                f"--spec {' '.join(SPEC_FLAG)} needs flash_overlap enabled: add --flash-overlap "
                'or "flash_overlap": {"enabled": true} to the --deepspeed-config JSON'
            )
        own_posters()
    return block_spec(args, name, overlap)


def _lazy_block(name: str) -> Any:
    """Megatron-LM reads ``vars(module)[name]`` before it knows the layer count; a
    TransformerBlockSubmodules whose fields are computed when the block reads them (after the flags
    are parsed) stands there. None when megatron-core is not importable (Megatron-DeepSpeed's older
    megatron package comes first there: it has no specs)."""
    try:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    except ImportError:
        return None

    class LazyBlockSubmodules(TransformerBlockSubmodules):
        def __init__(self) -> None:  # the dataclass fields are the properties below
            pass

        def __repr__(self) -> str:
            return f"<--spec {__name__} {name}>"

        @property
        def layer_specs(self) -> list:
            return _spec(name).layer_specs

        @property
        def layer_norm(self) -> Any:
            return _spec(name).layer_norm

    return LazyBlockSubmodules()


flash_overlap_layer_spec = _lazy_block(SPEC_ATTRIBUTE)
local_layer_spec = _lazy_block(LOCAL_SPEC_ATTRIBUTE)
