"""Hooks for upstream training scripts: Megatron-LM (tag core_v0.16.1) and Megatron-DeepSpeed.

The patches in ``patches/`` call these functions where the scripts have no hook of their own; see
docs/integration.md. Megatron-LM and Megatron-DeepSpeed are not dependencies of the suite: their
modules are imported inside the functions that need them, so this module imports without them.

* Flags: :func:`with_plugin_args` is the ``extra_args_provider`` given to ``pretrain()``.
* Data (Megatron-LM): :class:`DatasetsProvider` wraps ``train_valid_test_datasets_provider``; with
  the shared-memory loader on it returns this rank's batch iterators instead of datasets, and
  :func:`get_batch_on_this_tp_rank` then takes every rank's batch from its own iterator (no TP
  broadcast). With the loader off both hand over to Megatron-LM unchanged.
* Data (Megatron-DeepSpeed): :func:`megatron_deepspeed_data_iterators` and :func:`text_batch`.
* Model (Megatron-LM): ``--spec megatron_ext.megatron_lm flash_overlap_layer_spec`` (or
  ``local_layer_spec``, the same block without the plugin), built by :mod:`megatron_ext.upstream_spec`.
* Engine (Megatron-DeepSpeed): :func:`zero_init` and :func:`deepspeed_initialize` for hierarchical ZeRO.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_ext.config import (
    ConfigError,
    PluginConfig,
    load_plugin_config,
    log_effective_config,
    validate_against_world,
)
from megatron_ext.args import extra_args_provider, flag_overrides, plugin_config_from_args

logger = logging.getLogger(__name__)

MEGATRON_LM_TAG = "core_v0.16.1"
SPEC_ATTRIBUTE = "flash_overlap_layer_spec"
SPEC_FLAG = [__name__, SPEC_ATTRIBUTE]
"""The value of Megatron-LM's ``args.spec`` that selects the Flash-Overlap block."""
LOCAL_SPEC_ATTRIBUTE = "local_layer_spec"  # the same block without the plugin: the baseline at SP without Apex/TE

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
# Megatron's --dataloader-type -> the sampler of megatron_ext.data.samplers
_SAMPLERS = {"single": "single", "cyclic": "random"}
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
_PACKED_KEYS = ("cu_seqlens", "max_seqlen", "local_cp_size")  # packed sequences: never produced by our loader

_iterators: weakref.WeakSet = weakref.WeakSet()  # every iterator built here: get_batch recognises them
_effective: tuple[argparse.Namespace, PluginConfig] | None = None


# -- flags and the effective configuration ------------------------------------------------------

def with_plugin_args(base: ArgsProvider | None = None) -> ArgsProvider:
    """An ``extra_args_provider`` for ``pretrain()``: ``base``'s flags (Megatron-LM passes its
    ModelOpt flags there), the suite's flags, and ``--deepspeed-config PATH`` (the JSON with the
    plugin sections) unless the parser already has that flag."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if base is not None:
            parser = base(parser)
        parser = extra_args_provider(parser)
        try:
            parser.add_argument("--deepspeed-config", dest="deepspeed_config", default=None,
                                help="DeepSpeed JSON whose top-level plugin sections configure the suite")
        except argparse.ArgumentError:
            pass  # the script defines it already
        return parser

    return provider


def megatron_args() -> argparse.Namespace:
    """The parsed arguments of the running Megatron-LM or Megatron-DeepSpeed job."""
    try:
        from megatron.training import get_args  # Megatron-LM (Megatron-DeepSpeed re-exports it there too)
    except ImportError:
        raise RuntimeError(
            "Megatron-LM's megatron.training is not importable: the hooks of megatron_ext.megatron_lm run inside "
            "Megatron-LM's or Megatron-DeepSpeed's pretrain(); outside it, call megatron_ext.data.loader and "
            "megatron_ext.layers.spec directly"
        ) from None
    return get_args()


def is_megatron_deepspeed(args: argparse.Namespace) -> bool:
    """Megatron-DeepSpeed's parser holds DeepSpeed's ``--deepspeed`` flag; Megatron-LM's has none."""
    return hasattr(args, "deepspeed")


def plugin_config(args: argparse.Namespace | None = None) -> PluginConfig:
    """The effective plugin configuration of the job (default: Megatron's global ``args``), checked
    against what the script supports and logged the first time it is asked for."""
    global _effective
    args = args if args is not None else megatron_args()
    if _effective is None or _effective[0] is not args:
        # Megatron-DeepSpeed moves the JSON into args.deepspeed_config_dict and clears the path.
        ds_dict = getattr(args, "deepspeed_config_dict", None)
        config = load_plugin_config(ds_dict, **flag_overrides(args)) if ds_dict else plugin_config_from_args(args)
        validate_against_world(config, args.world_size, args.data_parallel_size)
        _check_supported(args, config)
        log_effective_config(config, dist.get_rank() if dist.is_initialized() else 0)
        _effective = (args, config)
    return _effective[1]


def _check_supported(args: argparse.Namespace, config: PluginConfig) -> None:
    """What the hooks cannot honour fails here, at start-up, with the flag to change."""
    mds = is_megatron_deepspeed(args)
    if config.shm_data_loader.enabled:
        if getattr(args, "pipeline_model_parallel_size", 1) != 1:
            raise ConfigError("shm_data_loader supports --pipeline-model-parallel-size 1 only (every rank of a node "
                              "must consume its ring): disable shm_data_loader or pipeline parallelism")
        for flag in ("full_validation", "sft", "hybrid_context_parallel", "data_efficiency_curriculum_learning"):
            if getattr(args, flag, False):
                raise ConfigError(f"shm_data_loader cannot be combined with --{flag.replace('_', '-')}: "
                                  "drop one of them")
        if getattr(args, "dataloader_type", "single") not in _SAMPLERS:
            raise ConfigError(f"--dataloader-type {args.dataloader_type} with shm_data_loader: the plugin loader "
                              "replaces the data loader; choose its order with --dataloader-type single or cyclic")
        if getattr(args, "ds_sequence_parallel_size", 1) > 1:
            raise ConfigError("shm_data_loader does not support --ds-sequence-parallel-size > 1: disable one of them")
        if mds and getattr(args, "deepspeed", False) and not getattr(args, "no_pipeline_parallel", False):
            raise ConfigError("shm_data_loader feeds get_batch, which DeepSpeed's pipeline engine bypasses: "
                              "pass --no-pipeline-parallel")
    if config.hierarchical_zero.enabled and not getattr(args, "deepspeed", False):
        raise ConfigError("hierarchical_zero is a DeepSpeed ZeRO-3 variant: pass --deepspeed (Megatron-DeepSpeed); "
                          "Megatron-LM trains without DeepSpeed, so disable hierarchical_zero there")
    if config.flash_overlap.enabled:
        if mds:
            raise ConfigError("flash_overlap needs megatron-core layer specs; Megatron-DeepSpeed's GPT model is "
                              "the legacy one: disable flash_overlap")
        spec = getattr(args, "spec", None)
        if list(spec or []) != SPEC_FLAG:
            raise ConfigError(f"flash_overlap is enabled but --spec is {spec}: pass "
                              f"--spec {' '.join(SPEC_FLAG)} so that Megatron-LM builds the Flash-Overlap layers")
        # The layers refuse these too; here the message names Megatron-LM's flag.
        if getattr(args, "tensor_model_parallel_size", 1) > 1 and not getattr(args, "sequence_parallel", False):
            raise ConfigError("flash_overlap overlaps the sequence-parallel collectives: pass --sequence-parallel")


def shm_loader_enabled() -> bool:
    """Whether the job feeds batches through the shared-memory loader (then every rank builds the
    datasets: the patched ``is_dataset_built_on_rank`` asks this)."""
    return plugin_config().shm_data_loader.enabled


# -- data ---------------------------------------------------------------------------------------

def _consumed_train_samples(args: argparse.Namespace) -> int:
    """Where training resumes in the training set (Megatron-LM counts from the last phase transition)."""
    transitions = getattr(args, "phase_transition_iterations", None)
    if transitions:
        last = max(it for it in (0, *transitions) if it <= args.iteration)
        return (args.iteration - last) * args.global_batch_size
    return args.consumed_train_samples


def external_data_iterators(
    datasets: Sequence[Any], args: argparse.Namespace, config: PluginConfig | None = None,
) -> tuple[Iterator[dict[str, torch.Tensor]] | None, ...]:
    """This rank's train, valid and test iterators over ``datasets`` (None where a dataset is None),
    built with :func:`megatron_ext.data.loader.build_batch_iterator` from Megatron's ``args``: micro
    batch, samples consumed so far (resume), ``--dataloader-type`` single or cyclic as the sampler,
    ``--no-data-sharding``, ``--no-create-attention-mask-in-dataloader``, ``--num-workers`` (stock path).
    Collective: every rank calls it."""
    from megatron.core import parallel_state as mpu

    from deepspeed_ext.topology import detect_topology
    from megatron_ext.data.loader import build_batch_iterator

    config = config or plugin_config(args)
    loader = config.shm_data_loader
    sampler = _SAMPLERS.get(args.dataloader_type)
    if sampler is None:
        raise ConfigError(f"--dataloader-type {args.dataloader_type}: the plugin loader takes single or cyclic")
    topology = detect_topology(config.topology, world_size=dist.get_world_size()) if loader.enabled else None
    consumed = (0 if getattr(args, "skip_train", False) else _consumed_train_samples(args),
                args.consumed_valid_samples, 0)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    iterators: list[Any] = []
    for name, dataset, start in zip(("train", "valid", "test"), datasets, consumed):
        if dataset is None or (name == "train" and getattr(args, "skip_train", False)):
            iterators.append(None)
            continue
        iterator = build_batch_iterator(
            dataset, micro_batch_size=args.micro_batch_size, consumed_samples=start, config=loader,
            topology=topology, tp_group=mpu.get_tensor_model_parallel_group(), dp_rank=mpu.get_data_parallel_rank(),
            dp_size=mpu.get_data_parallel_world_size(), sampler=sampler, data_sharding=getattr(args, "data_sharding", True),
            create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", False), name=name, device=device,
            num_workers=getattr(args, "num_workers", 0),
        )
        _iterators.add(iterator)
        iterators.append(iterator)
    return tuple(iterators)


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
        args.dataloader_type = "external"
        return iterators


def is_plugin_iterator(data_iterator: Any) -> bool:
    """Whether ``data_iterator`` (or what Megatron-LM's RerunDataIterator wraps) was built here."""
    return getattr(data_iterator, "iterable", data_iterator) in _iterators


def get_batch_on_this_tp_rank(data_iterator: Any, mtp_on_this_rank: bool = False) -> dict[str, Any]:
    """Megatron-LM's ``get_batch_on_this_tp_rank`` for the plugin iterators: every rank takes its
    micro-batch from its own iterator (the node's ring, or the stock path, which broadcasts inside
    ``next``). Any other iterator (or None) goes to Megatron-LM's own function."""
    if not is_plugin_iterator(data_iterator):
        from megatron.training.utils import get_batch_on_this_tp_rank as upstream

        return upstream(data_iterator, mtp_on_this_rank=mtp_on_this_rank)
    batch = next(data_iterator)
    return {key: batch.get(key) for key in _BATCH_KEYS + _PACKED_KEYS}


# -- Megatron-DeepSpeed ---------------------------------------------------------------------------

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

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.as_tensor(self.samples[idx]["text"], dtype=torch.int64)
        seq = self.config.sequence_length
        if text.shape != (seq + 1,):
            raise ValueError(f"sample {idx} has {tuple(text.shape)} tokens, expected ({seq + 1},) for --seq-length "
                             f"{seq}: rebuild the dataset index for this sequence length")
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(seq, dtype=torch.float32),
                "position_ids": torch.arange(seq)}


def megatron_deepspeed_data_iterators(provider: Callable[..., Any]) -> tuple[Any, ...]:
    """Megatron-DeepSpeed's ``build_train_valid_test_data_iterators`` with the shared-memory loader:
    datasets on every rank, plugin iterators over them, and the do_train/valid/test flags set."""
    from megatron.core import parallel_state as mpu
    from megatron.training import build_train_valid_test_datasets

    args = megatron_args()
    if args.iteration > 0 and args.consumed_train_samples == 0:  # checkpoints that predate the counter
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.train_samples is None:
        args.consumed_valid_samples = (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    # Upstream builds on TP rank 0 only, and its index maps are written by rank 0 and awaited within the
    # data-parallel group: those ranks go first, the others then find the maps written.
    first = mpu.get_tensor_model_parallel_rank() == 0
    built = build_train_valid_test_datasets(provider) if first else None
    dist.barrier()
    built = built if first else build_train_valid_test_datasets(provider)
    datasets = [None if d is None else TextSamples(d, args.seq_length) for d in built]
    iterators = external_data_iterators(datasets, args)
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
    """``deepspeed.zero.Init(**kwargs)``; with hierarchical ZeRO it is disabled, because the variant
    partitions over its own level groups when :func:`deepspeed_initialize` builds the engine (the
    model is built whole on each rank first, as in the suite's main job)."""
    import deepspeed

    if plugin_config().hierarchical_zero.enabled and kwargs.get("enabled", True):
        logger.info("hierarchical_zero: the model is built unpartitioned and partitioned by the engine")
        kwargs["enabled"] = False
    return deepspeed.zero.Init(**kwargs)


def deepspeed_initialize(**kwargs: Any) -> tuple:
    """``deepspeed.initialize(**kwargs)``, or the hierarchical ZeRO-3 variant when it is enabled."""
    import deepspeed

    config = plugin_config()
    if not config.hierarchical_zero.enabled:
        return deepspeed.initialize(**kwargs)
    if kwargs.get("mpu") is None:
        raise ConfigError("hierarchical_zero needs Megatron's process groups: pass --no-pipeline-parallel "
                          "(ZeRO-3 runs without DeepSpeed's pipeline engine)")
    from deepspeed_ext.zero import initialize

    return initialize(plugin_config=config, **kwargs)


# -- model (Megatron-LM --spec) -------------------------------------------------------------------

def _spec(name: str) -> Any:
    """The block behind ``--spec megatron_ext.megatron_lm <name>``, built from the parsed flags."""
    from megatron_ext.upstream_spec import block_spec

    args = megatron_args()
    overlap = None
    if name == SPEC_ATTRIBUTE:
        overlap = plugin_config(args).flash_overlap
        if not overlap.enabled:
            raise ConfigError(f"--spec {' '.join(SPEC_FLAG)} needs flash_overlap enabled: add --flash-overlap "
                              'or "flash_overlap": {"enabled": true} to the --deepspeed-config JSON')
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
