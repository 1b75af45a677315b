"""The shared-memory node loader against Megatron-LM's own batch path, called from the upstream
core_v0.16.1 tree (nothing of it rewritten here), at 4 gloo ranks on one node.

Upstream's path, as its ``pretrain_gpt.py`` runs it: the ranks that build the dataset (TP rank 0 of
the first and last pipeline stage) read it through ``build_pretraining_data_loader`` (Megatron's
sampler and a torch DataLoader), wrapped as ``build_train_valid_test_data_iterators`` wraps it;
``megatron.training.utils.get_batch_on_this_tp_rank`` takes a micro-batch there and broadcasts it to
the other TP ranks; ``get_batch`` pops the packed-sequence keys and slices the batch for context
parallelism with megatron-core's ``get_batch_on_this_cp_rank``.

Ours: the patched ``pretrain_gpt.py`` builds the loader through the hook (``DatasetsProvider`` ->
``external_data_iterators`` -> ``build_batch_iterator`` with ``shm_data_loader`` enabled), and
calls ``megatron_ext.integration.upstream.megatron_lm.get_batch_on_this_tp_rank`` instead. Every rank's dicts
must equal upstream's: the same keys in the same order (``get_batch`` hands the values on by
position), None where upstream has None, tensors equal in dtype, shape and value.

Upstream runs beside the installed megatron-core: the tree is appended to ``sys.path`` (only
``megatron.training`` and ``megatron.legacy`` come from it) and its CUDA calls go to the CPU through
the suite's shim for upstream runs; all of it is undone before the rank function returns.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.integration.plugin_config import PluginConfig
from megatron_ext.trainer.corpus import gpt_dataset_config
from tests.helpers.shm import MBS, SEQ
from tests.helpers.upstream import SetupError, prepare

STEPS = 6
ALL = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
PACKED = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")  # what get_batch pops


@pytest.fixture(scope="module")
def tree() -> str:
    """The pristine Megatron-LM core_v0.16.1 tree (unpatched: its own functions are the reference)."""
    try:
        return str(prepare()["megatron-lm"].pristine)
    except SetupError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"upstream reference tests cannot run in CI: {exc}")
        pytest.skip(f"upstream reference tests need: {exc}")


def _megatron_args(
    *, tp: int = 1, pp: int = 1, cp: int = 1, mask: bool, documents_apart: bool = False, **overrides: Any
) -> argparse.Namespace:
    """Megatron-LM's global arguments, holding what the functions called here read (a missing one
    fails with AttributeError rather than taking a default)."""
    args = argparse.Namespace(
        # get_batch_on_this_tp_rank
        micro_batch_size=MBS,
        seq_length=SEQ,
        pipeline_model_parallel_size=pp,
        hybrid_context_parallel=False,
        create_attention_mask_in_dataloader=mask,
        sft=False,
        # build_pretraining_data_loader
        dataloader_type="single",
        data_sharding=True,
        num_workers=0,
        full_validation=False,
        exit_signal_handler=False,
        # the dataset's config (pretrain_gpt.core_gpt_dataset_config_from_args)
        seed=1234,
        reset_attention_mask=documents_apart,
        reset_position_ids=documents_apart,
        eod_mask_loss=False,
        # the plugin hook
        consumed_train_samples=0,
        consumed_valid_samples=0,
        skip_train=False,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
    )
    return argparse.Namespace(**{**vars(args), **overrides})


def _dataset(prefix: str, cache: str, args: argparse.Namespace) -> Any:
    """The megatron-core GPTDataset both paths read, configured from ``args`` as upstream's
    ``core_gpt_dataset_config_from_args`` does: the dataset itself builds the attention mask when
    ``create_attention_mask_in_dataloader`` is set (document-aware with ``reset_attention_mask``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = dataclasses.replace(
        gpt_dataset_config(
            prefix,
            args.seq_length,
            args.seed,
            cache,
            create_attention_mask=args.create_attention_mask_in_dataloader,
        ),
        reset_attention_mask=args.reset_attention_mask,
        reset_position_ids=args.reset_position_ids,
        eod_mask_loss=args.eod_mask_loss,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, config).build()[0]


@contextlib.contextmanager
def _upstream_megatron_lm(tree: str, args: argparse.Namespace) -> Iterator[None]:
    """Upstream's ``megatron.training`` importable beside the installed ``megatron.core``, ``args``
    as its global arguments, the rerun state machine its iterators consult, and the CPU shim the
    launcher puts around upstream runs; on exit every one of them is undone and the tree's modules
    are forgotten (the worker pool is shared with other tests)."""
    import megatron.core
    from megatron.core import rerun_state_machine

    from megatron_ext.integration.upstream import scripts_on_cpu as upstream_cpu

    inside = tree.rstrip(os.sep) + os.sep
    before = set(sys.modules)
    sys.path.append(tree)  # after site-packages: megatron.core stays the installed package
    created_rerun = rerun_state_machine._GLOBAL_RERUN_STATE_MACHINE is None
    try:
        from megatron.training import global_vars, utils

        assert utils.__file__.startswith(inside), utils.__file__
        assert not megatron.core.__file__.startswith(inside), megatron.core.__file__
        assert not sys.modules[utils.get_batch_on_this_cp_rank.__module__].__file__.startswith(inside)
        global_vars.set_args(args)
        if created_rerun:
            rerun_state_machine.initialize_rerun_state_machine()  # as initialize_megatron does
        shimmed = upstream_cpu.enable()
        try:
            yield
        finally:
            if shimmed:
                upstream_cpu.disable()
            global_vars.set_args(None)
    finally:
        if created_rerun:
            rerun_state_machine.destroy_rerun_state_machine()
        sys.path.remove(tree)
        for name in set(sys.modules) - before:
            module = sys.modules[name]
            where = [getattr(module, "__file__", None) or "", *getattr(module, "__path__", [])]
            if any(place.startswith(inside) for place in where):
                del sys.modules[name]
                parent, _, child = name.rpartition(".")
                if getattr(sys.modules.get(parent), child, None) is module:
                    delattr(sys.modules[parent], child)


def _upstream_iterator(dataset: Any, args: argparse.Namespace) -> Any:
    """Upstream's train iterator on the ranks where ``pretrain_gpt.is_dataset_built_on_rank`` holds
    (TP rank 0 of the first and last stage), None elsewhere, as its
    ``build_train_valid_test_data_iterators`` wraps it."""
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader
    from megatron.training.training import cyclic_iter

    built_here = ps.get_tensor_model_parallel_rank() == 0 and (
        ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    )
    if not built_here:
        return None
    loader = build_pretraining_data_loader(dataset, args.consumed_train_samples)
    return RerunDataIterator(iter(cyclic_iter(loader) if args.dataloader_type == "cyclic" else loader))


def _our_iterator(dataset: Any, args: argparse.Namespace) -> Any:
    """The iterator the patched ``pretrain_gpt.py`` gets from the hook with the node loader on,
    wrapped as upstream wraps an ``external`` one."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_ext.data.shm.node_loader import ShmBatchIterator
    from megatron_ext.integration.upstream.hooks import external_data_iterators

    config = PluginConfig(shm_data_loader=ShmDataLoaderConfig(enabled=True, slots=3, timeout_s=60))
    ours = external_data_iterators((dataset, None, None), args, config)[0]
    assert isinstance(ours, ShmBatchIterator), type(ours)  # the node's ring, not the stock path
    return RerunDataIterator(ours)


def _cp_sliced(batch: dict[str, Any]) -> dict[str, Any]:
    """What ``pretrain_gpt.get_batch`` does after ``get_batch_on_this_tp_rank`` when the batch is not
    packed: pop the packed-sequence keys, slice with megatron-core's ``get_batch_on_this_cp_rank``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    popped = {key: batch.pop(key, None) for key in PACKED}
    assert popped == dict.fromkeys(PACKED), f"a packed batch: {popped}"
    return get_batch_on_this_cp_rank(batch)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return repr(value)


def _differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    """Where our dicts differ from upstream's, key by key with the steps it happens at (empty when equal)."""
    found: dict[str, list[int]] = {}
    if len(ours) != len(theirs):
        found[f"{len(ours)} batches, upstream {len(theirs)}"] = []
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if list(a) != list(b):
            found.setdefault(f"keys {list(a)}, upstream {list(b)}", []).append(step)
        for key in b:
            x, y = a.get(key), b[key]
            if (x is None) != (y is None) or (y is not None and (x.dtype, x.shape) != (y.dtype, y.shape)):
                found.setdefault(f"{key}: ours {_describe(x)}, upstream {_describe(y)}", []).append(step)
            elif y is not None and not torch.equal(x, y):
                found.setdefault(f"{key}: values differ", []).append(step)
    return [f"{what} (steps {steps})" for what, steps in found.items()]


def _assert_same_as_upstream(results: list[dict]) -> None:
    report = [f"rank {rank}: {line}" for rank, r in enumerate(results) for line in r["differences"]]
    assert not report, "batches differ from upstream Megatron-LM's:\n" + "\n".join(report)


def _restarted_windows(batch: dict[str, Any]) -> int:
    """Samples of an uncut batch whose position ids restart (an EOD inside the window)."""
    positions = batch.get("position_ids")
    if positions is None:
        return 0
    return int((positions != torch.arange(positions.shape[1])).any(dim=1).sum())


def _compare(tree: str, prefix: str, cache: str, args: argparse.Namespace, cp_slice: bool) -> dict:
    """On each rank: upstream's batches for STEPS steps, then ours over the same dataset and
    arguments, both inside the upstream set-up (as a CPU run of the patched script has it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.upstream.megatron_lm import get_batch_on_this_tp_rank as ours_get_batch

    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        create_gloo_process_groups=False,
    )
    dataset = _dataset(prefix, cache, args)
    with _upstream_megatron_lm(tree, args):
        from megatron.training.utils import get_batch_on_this_tp_rank

        upstream = _upstream_iterator(dataset, args)
        theirs = [get_batch_on_this_tp_rank(upstream) for _ in range(STEPS)]
        ours_iterator = _our_iterator(dataset, args)
        try:
            ours = [ours_get_batch(ours_iterator) for _ in range(STEPS)]
        finally:
            ours_iterator.iterable.close()
        restarts = sum(_restarted_windows(b) for b in theirs)
        if cp_slice:
            theirs, ours = [_cp_sliced(b) for b in theirs], [_cp_sliced(b) for b in ours]
    dist.barrier()
    return dict(
        differences=_differences(ours, theirs),
        restarted_windows=restarts,
        upstream_keys=[k for k, v in theirs[0].items() if v is not None],
        upstream_all_keys=list(theirs[0]),
        tokens_shape=list(theirs[0]["tokens"].shape) if theirs[0].get("tokens") is not None else None,
        tokens=[b["tokens"].sum().item() for b in theirs] if theirs[0].get("tokens") is not None else None,
    )


@pytest.mark.parametrize("mask", [True, False], ids=["mask", "no-mask"])
def test_tp2_pp2_every_rank_gets_what_upstreams_get_batch_on_this_tp_rank_returns(
    run_ranks, tree, gpt_corpus, mask
):
    """TP=2 x PP=2 (ranks 0, 1 the first stage, 2, 3 the last), Megatron's single sampler. Upstream's
    ``get_batch_on_this_tp_rank`` at PP > 1 leaves TP rank 0 of each stage the whole micro-batch it
    read (tokens, labels, loss_mask, attention_mask, position_ids), and gives the other TP ranks only
    what it broadcasts to their stage: tokens, attention_mask, position_ids on the first, labels,
    loss_mask, attention_mask on the last, None for the rest. The attention mask is there only with
    ``create_attention_mask_in_dataloader`` (the dataset builds it); cu_seqlens, max_seqlen and
    local_cp_size are None (no packed sequences)."""
    args = _megatron_args(tp=2, pp=2, mask=mask)
    results = run_ranks(4, _compare, tree, *gpt_corpus, args, False, timeout=180)
    first = ["tokens", "attention_mask", "position_ids"]
    last = ["labels", "loss_mask", "attention_mask"]
    expected = [list(ALL), first, list(ALL), last]
    assert [r["upstream_keys"] for r in results] == [
        [k for k in keys if mask or k != "attention_mask"] for keys in expected
    ]
    assert all(r["upstream_all_keys"] == [*ALL, "cu_seqlens", "max_seqlen", "local_cp_size"] for r in results)
    assert results[0]["tokens"] == results[1]["tokens"] == results[2]["tokens"]  # one DP stream
    _assert_same_as_upstream(results)


@pytest.mark.parametrize(
    "mask,documents_apart",
    [(False, False), (True, False), (True, True)],
    ids=["no-mask", "mask", "documents-apart"],
)
def test_cp2_dp2_batches_after_get_batch_on_this_cp_rank_are_upstreams(
    run_ranks, tree, gpt_corpus, mask, documents_apart
):
    """TP=1 x CP=2 x DP=2 (ranks 0, 1 the CP pair of DP rank 0, ranks 2, 3 that of DP rank 1),
    Megatron's cyclic loader (its random sampler, data sharding on) resumed at 10 global batches.
    Upstream: each rank is TP rank 0 and reads its DP rank's micro-batch (the CP pair reads the same
    samples), ``get_batch`` slices every key along the sequence into 2 x CP chunks and keeps chunks
    cp_rank and 2 x CP - 1 - cp_rank (the attention mask along its query dimension). With
    ``reset_attention_mask`` and ``reset_position_ids`` the dataset's masks keep documents apart and
    position ids restart after each EOD."""
    args = _megatron_args(
        cp=2,
        mask=mask,
        documents_apart=documents_apart,
        dataloader_type="cyclic",
        consumed_train_samples=10 * MBS * 2,  # 10 global batches of MBS x DP
    )
    results = run_ranks(4, _compare, tree, *gpt_corpus, args, True, timeout=180)
    assert [r["upstream_keys"] for r in results] == [[k for k in ALL if mask or k != "attention_mask"]] * 4
    assert all(r["tokens_shape"] == [MBS, SEQ // 2] for r in results)
    assert results[0]["tokens"] != results[1]["tokens"]  # the two halves of one micro-batch
    assert results[0]["tokens"] != results[2]["tokens"]  # DP ranks read different samples
    restarted = [r["restarted_windows"] for r in results]
    assert (sum(restarted) > 0) if documents_apart else (restarted == [0] * 4), restarted
    _assert_same_as_upstream(results)
