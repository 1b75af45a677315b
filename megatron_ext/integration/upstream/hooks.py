"""What the upstream hooks share: the plugin flags, the effective configuration and the data iterators.

:mod:`megatron_ext.integration.upstream.megatron_lm` and :mod:`megatron_ext.integration.upstream.megatron_deepspeed` hold
what each upstream script calls (through ``patches/``); both go through the functions here.
Megatron-LM and Megatron-DeepSpeed are not dependencies of the suite: their modules are imported
inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError
from megatron_ext.data.batch import BatchIterator
from megatron_ext.data.dataset import SampleDataset
from megatron_ext.integration.args import extra_args_provider, flag_overrides, plugin_config_from_args
from megatron_ext.integration.plugin_config import (
    PluginConfig,
    load_plugin_config,
    log_effective_config,
    validate_against_world,
)

logger = logging.getLogger(__name__)

SPEC_MODULE = "megatron_ext.integration.upstream.megatron_lm"
SPEC_ATTRIBUTE = "flash_overlap_layer_spec"
SPEC_FLAG = [SPEC_MODULE, SPEC_ATTRIBUTE]
"""The value of Megatron-LM's ``args.spec`` that selects the Flash-Overlap block."""
LOCAL_SPEC_ATTRIBUTE = (
    "local_layer_spec"  # the same block without the plugin: the baseline at SP without Apex/TE
)

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

_iterators: weakref.WeakSet[BatchIterator] = (
    weakref.WeakSet()
)  # every iterator built here: get_batch recognises them
_effective: tuple[argparse.Namespace, PluginConfig] | None = None
_installer: Installer | None = None  # the launcher's, while the upstream script runs


# -- process-wide changes -----------------------------------------------------------------------


@contextlib.contextmanager
def owning(installer: Installer) -> Iterator[Installer]:
    """Makes the hooks' process-wide changes go through ``installer`` while the block runs
    (``megatron_ext.launch`` holds one around the upstream script).

    Args:
        installer: the launcher's installer.

    Returns:
        A context manager yielding ``installer``.
    """
    global _installer
    previous, _installer = _installer, installer
    try:
        yield installer
    finally:
        _installer = previous


def installer() -> Installer:
    """The installer the hooks' process-wide changes go through."""
    if _installer is None:
        raise RuntimeError(
            "the upstream hooks run inside python -m megatron_ext.launch, which owns and undoes what they "
            "start (engines, loader processes, threads): start the upstream script through it"
        )
    return _installer


def own_iterators(iterators: Sequence[BatchIterator | None]) -> None:
    """Ends the loaders' producer processes and shared-memory segments with the upstream run.

    Args:
        iterators: the iterators :func:`external_data_iterators` returned (None ones are skipped).
    """
    for iterator in iterators:
        if iterator is not None:
            installer().add(
                "megatron_ext.data", "a loader (its producer and shared-memory segment)", iterator.close
            )


def own_posters() -> None:
    """Flash-Overlap's P2P poster thread (started by its first gloo step) stops with the upstream run."""
    from megatron_ext.layers.p2p.link import shutdown_posters

    owner = installer()
    if not any(change.owner == "megatron_ext.layers" for change in owner.changes):
        owner.add("megatron_ext.layers", "the P2P poster thread (gloo)", shutdown_posters)


# -- flags and the effective configuration ------------------------------------------------------


def with_plugin_args(base: ArgsProvider | None = None) -> ArgsProvider:
    """An ``extra_args_provider`` for ``pretrain()``.

    Args:
        base: the script's own provider (Megatron-LM passes its ModelOpt flags there), or None.

    Returns:
        A provider adding ``base``'s flags, the suite's flags, and ``--deepspeed-config PATH`` (the
        JSON with the plugin sections) unless the parser already has that flag.
    """

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if base is not None:
            parser = base(parser)
        parser = extra_args_provider(parser)
        try:
            parser.add_argument(
                "--deepspeed-config",
                dest="deepspeed_config",
                default=None,
                help="DeepSpeed JSON whose top-level plugin sections configure the suite",
            )
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
            "Megatron-LM's megatron.training is not importable: the hooks of megatron_ext.integration.upstream run inside "
            "Megatron-LM's or Megatron-DeepSpeed's pretrain(); outside it, call megatron_ext.data.loader and "
            "megatron_ext.layers.spec directly"
        ) from None
    return get_args()


def is_megatron_deepspeed(args: argparse.Namespace) -> bool:
    """Megatron-DeepSpeed's parser holds DeepSpeed's ``--deepspeed`` flag; Megatron-LM's has none."""
    return hasattr(args, "deepspeed")


def plugin_config(args: argparse.Namespace | None = None) -> PluginConfig:
    """The effective plugin configuration of the job, checked against the world and what the
    running upstream supports and logged the first time it is asked for.

    Args:
        args: Megatron's arguments; None: its global ``args``.

    Returns:
        The configuration: the DeepSpeed JSON's sections with the command line's flags on top.

    Raises:
        ConfigError: a setting the job cannot honour, naming the flag or key to change.
    """
    global _effective
    args = args if args is not None else megatron_args()
    if _effective is None or _effective[0] is not args:
        # Megatron-DeepSpeed moves the JSON into args.deepspeed_config_dict and clears the path.
        ds_dict = getattr(args, "deepspeed_config_dict", None)
        config = (
            load_plugin_config(ds_dict, **flag_overrides(args)) if ds_dict else plugin_config_from_args(args)
        )
        validate_against_world(config, args.world_size, args.data_parallel_size)
        _check_supported(args, config)
        # Checked before the process group too (megatron_ext.integration.upstream.startup): Megatron's rank then.
        log_effective_config(config, dist.get_rank() if dist.is_initialized() else getattr(args, "rank", 0))
        _effective = (args, config)
    return _effective[1]


HIERARCHICAL_ZERO_NEEDS_MEGATRON_GROUPS = (
    "hierarchical_zero needs Megatron's process groups: pass --no-pipeline-parallel "
    "(ZeRO-3 runs without DeepSpeed's pipeline engine)"
)


def _check_supported(args: argparse.Namespace, config: PluginConfig) -> None:
    """What the hooks cannot honour fails here, at start-up, with the flag to change: each plugin's
    checks (beside its configuration) and those that belong to the upstream running."""
    if is_megatron_deepspeed(args):
        _check_megatron_deepspeed(args, config)
    else:
        _check_megatron_lm(args, config)


def _check_megatron_lm(args: argparse.Namespace, config: PluginConfig) -> None:
    config.shm_data_loader.check_megatron_args(args)
    config.hierarchical_zero.check_megatron_args(args)
    spec = getattr(args, "spec", None)
    if config.flash_overlap.enabled and list(spec or []) != SPEC_FLAG:
        raise ConfigError(
            f"flash_overlap is enabled but --spec is {spec}: pass "
            f"--spec {' '.join(SPEC_FLAG)} so that Megatron-LM builds the Flash-Overlap layers"
        )
    config.flash_overlap.check_megatron_args(args)


def _check_megatron_deepspeed(args: argparse.Namespace, config: PluginConfig) -> None:
    loader = config.shm_data_loader
    if loader.enabled and getattr(args, "pipeline_model_parallel_size", 1) > 1:
        raise ConfigError(
            "shm_data_loader with Megatron-DeepSpeed supports --pipeline-model-parallel-size 1 "
            "only: disable shm_data_loader or pipeline parallelism"
        )
    loader.check_megatron_args(args)
    if (
        loader.enabled
        and getattr(args, "deepspeed", False)
        and not getattr(args, "no_pipeline_parallel", False)
    ):
        raise ConfigError(
            "shm_data_loader feeds get_batch, which DeepSpeed's pipeline engine bypasses: "
            "pass --no-pipeline-parallel"
        )
    config.hierarchical_zero.check_megatron_args(args)
    if config.hierarchical_zero.enabled and not getattr(args, "no_pipeline_parallel", False):
        # DeepSpeed's pipeline engine gets no mpu, so the variant would find out only after the build.
        raise ConfigError(HIERARCHICAL_ZERO_NEEDS_MEGATRON_GROUPS)
    config.flash_overlap.check_legacy_model_args(args)


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
    datasets: Sequence[SampleDataset | None],
    args: argparse.Namespace,
    config: PluginConfig | None = None,
) -> tuple[BatchIterator | None, ...]:
    """This rank's train, valid and test iterators, built with
    :func:`megatron_ext.data.loader.build_batch_iterator`. Collective: every rank calls it (middle
    pipeline stages too: they take part in the set-up and then follow the sampler only).

    Args:
        datasets: the train, valid and test datasets (None where there is none).
        args: Megatron's arguments: micro batch, samples consumed so far (resume),
            ``--dataloader-type``, ``--no-data-sharding``, ``--num-workers`` and the like.
        config: the plugin configuration; None: :func:`plugin_config`'s.

    Returns:
        One iterator per dataset, None where the dataset is None (or training is skipped).
    """
    from mdsp_base.topology import detect_topology
    from megatron_ext.data.loader import LoaderSettings, build_batch_iterator

    config = config or plugin_config(args)
    loader = config.shm_data_loader
    topology = detect_topology(config.topology, world_size=dist.get_world_size()) if loader.enabled else None
    consumed = (
        0 if getattr(args, "skip_train", False) else _consumed_train_samples(args),
        args.consumed_valid_samples,
        0,
    )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    iterators: list[BatchIterator | None] = []
    for name, dataset, start in zip(("train", "valid", "test"), datasets, consumed):
        if dataset is None or (name == "train" and getattr(args, "skip_train", False)):
            iterators.append(None)
            continue
        settings = LoaderSettings.from_megatron_args(
            args, loader, topology, consumed_samples=start, name=name, device=device
        )
        iterator = build_batch_iterator(dataset, settings)
        _iterators.add(iterator)
        iterators.append(iterator)
    return tuple(iterators)


def is_plugin_iterator(data_iterator: object) -> bool:
    """Whether an iterator was built by :func:`external_data_iterators`.

    Args:
        data_iterator: what Megatron passes ``get_batch`` (a RerunDataIterator is looked through).

    Returns:
        True for the plugin's iterators.
    """
    return getattr(data_iterator, "iterable", data_iterator) in _iterators
