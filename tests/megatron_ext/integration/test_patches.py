"""The upstream patches (well-formed, touching only their files, applying to the pinned versions
when a checkout is given) and the hooks they call, run with a fake Megatron ``args``."""

import argparse
import contextlib
import os
import re
import subprocess
import sys
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext.integration.upstream import megatron_deepspeed, megatron_lm

ROOT = str(Path(__file__).resolve().parents[3])
PATCHES = os.path.join(ROOT, "patches")
# patch -> (files it may touch, env var naming an upstream checkout, pinned commit)
EXPECTED = {
    "megatron-lm-core_v0.16.1.patch": (
        {"pretrain_gpt.py"},
        "MEGATRON_LM_DIR",
        "55ac7082517c3878ae653c07c09c534b8aed49f6",
    ),
    "megatron-deepspeed-4efb479.patch": (
        {
            "pretrain_gpt.py",
            "megatron/training.py",
            "megatron/model/transformer.py",
            "megatron/core/tensor_parallel/layers.py",
        },
        "MEGATRON_DEEPSPEED_DIR",
        "4efb479d5317ce9b86096b9d8e3e8030b0b5263b",
    ),
}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _read(name):
    with open(os.path.join(PATCHES, name)) as f:
        return f.read()


def _parse(text):
    """{file: [(old_count, new_count, lines)]}; raises AssertionError on anything malformed."""
    files, hunks, current, lines = {}, None, None, iter(text.splitlines())
    for line in lines:
        if line.startswith("diff --git "):
            a, b = line.split()[2:4]
            assert a[2:] == b[2:] and a.startswith("a/") and b.startswith("b/"), (
                f"renames not expected: {line}"
            )
            current = a[2:]
            hunks = files.setdefault(current, [])
        elif line.startswith("--- "):
            assert line == f"--- a/{current}", line
            assert next(lines) == f"+++ b/{current}"
        elif line.startswith("@@"):
            m = HUNK.match(line)
            assert m and current, f"bad hunk header: {line}"
            old, new = int(m.group(2) or 1), int(m.group(4) or 1)
            body, seen_old, seen_new = [], 0, 0
            while seen_old < old or seen_new < new:
                row = next(lines)
                assert row[:1] in (" ", "-", "+"), f"{current}: bad hunk line {row!r}"
                seen_old += row[:1] in " -"
                seen_new += row[:1] in " +"
                body.append(row)
            assert (seen_old, seen_new) == (old, new), f"{current}: hunk counts {line} do not match its lines"
            hunks.append((old, new, body))
    return files


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patch_is_well_formed_and_minimal(name):
    files = _parse(_read(name))
    allowed, _, commit = EXPECTED[name]
    assert set(files) == allowed, f"{name} touches {sorted(files)}, expected {sorted(allowed)}"
    assert commit in _read(name).split("diff --git")[0], f"{name} must name the upstream commit {commit}"
    assert commit in _read("README.md"), f"patches/README.md must name {commit}"
    for path, hunks in files.items():
        for _, _, body in hunks:
            context = [row for row in body if row.startswith(" ")]
            assert len(context) <= 2, f"{name}:{path}: keep one context line per side"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patch_calls_existing_hooks(name):
    added = "\n".join(
        row
        for hunks in _parse(_read(name)).values()
        for _, _, body in hunks
        for row in body
        if row.startswith("+")
    )
    modules = {"megatron_lm": megatron_lm, "megatron_deepspeed": megatron_deepspeed}
    called = set(re.findall(r"\b(megatron_lm|megatron_deepspeed)\.(\w+)", added))
    assert called, f"{name} calls no hook"
    missing = sorted(f"{mod}.{n}" for mod, n in called if not callable(getattr(modules[mod], n, None)))
    assert not missing, f"{name} calls {missing}, which do not exist"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_patch_applies_upstream(name):
    """``git apply --check`` in the checkout named by the env var, else in the shipped upstream tree
    (the tarballs beside the project, unpacked once by tests.helpers.upstream)."""
    _, env, commit = EXPECTED[name]
    checkout = os.environ.get(env)
    if not checkout:
        from tests.helpers.upstream import SetupError, prepare

        try:
            trees = prepare()
        except SetupError as exc:
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail(f"no upstream tree to check {name} against: {exc}")
            pytest.skip(
                f"set {env} to an upstream checkout at commit {commit}, or provide the tarballs: {exc}"
            )
        checkout = str(
            trees["megatron-lm" if name.startswith("megatron-lm") else "megatron-deepspeed"].pristine
        )
    head = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = subprocess.run(
        ["git", "apply", "--check", os.path.join(PATCHES, name)], cwd=checkout, capture_output=True, text=True
    )
    assert result.returncode == 0, (
        f"{name} does not apply in {checkout} (HEAD {head or 'not a git checkout'}, "
        f"pinned {commit}):\n{result.stderr}"
    )


# -- the model hook (Megatron-LM's --spec) -----------------------------------------------------


def test_spec_is_what_megatron_lm_imports():
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # Megatron-LM's gpt_builder: transformer_layer_spec = import_module(args.spec), a block spec used as is.
    for name in (megatron_lm.SPEC_ATTRIBUTE, megatron_lm.LOCAL_SPEC_ATTRIBUTE):
        assert isinstance(import_module([megatron_lm.__name__, name]), TransformerBlockSubmodules)


def test_flash_overlap_submodules_follow_the_config():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_ext.integration.upstream.layer_specs import flash_overlap_submodules, layer_spec
    from megatron_ext.layers.config import FlashOverlapConfig
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear

    base = layer_spec().submodules
    overlap = FlashOverlapConfig(enabled=True, layers=["qkv", "fc2"], mode="ring", timeout_s=7)
    subs = flash_overlap_submodules(base, overlap)
    attention, mlp = subs.self_attention.submodules, subs.mlp.submodules
    assert issubclass(attention.linear_qkv, FlashOverlapColumnParallelLinear)
    assert issubclass(mlp.linear_fc2, FlashOverlapRowParallelLinear)
    assert (attention.linear_qkv.p2p_mode, mlp.linear_fc2.p2p_timeout_s) == ("ring", 7)
    assert attention.linear_proj is RowParallelLinear and mlp.linear_fc1 is ColumnParallelLinear
    assert base.self_attention.submodules.linear_qkv is ColumnParallelLinear, (
        "the module-level spec was changed"
    )


# -- Megatron-DeepSpeed's samples --------------------------------------------------------------


def test_text_samples_round_trip():
    seq = 6
    legacy = [{"text": np.arange(i, i + seq + 1, dtype=np.int64)} for i in range(3)]
    samples = megatron_deepspeed.TextSamples(legacy, seq)
    item = samples[2]
    assert len(samples) == 3 and samples.config.sequence_length == seq
    assert torch.equal(torch.cat([item["tokens"], item["labels"][-1:]]), torch.arange(2, 2 + seq + 1))
    with pytest.raises(ValueError, match="--seq-length 5"):
        megatron_deepspeed.TextSamples(legacy, 5)[0]


# -- the data hooks on 2 ranks, against build_batch_iterator -----------------------------------

SEQ, MBS, STEPS = 32, 2, 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatron_ext.trainer.corpus import synthetic_documents, write_indexed_dataset

    root = tmp_path_factory.mktemp("hooks-corpus")
    prefix = str(root / "corpus")
    write_indexed_dataset(prefix, synthetic_documents(40))
    _dataset(prefix, str(root / "cache"))  # index caches built once, before the ranks read them
    return prefix, str(root / "cache")


def _dataset(prefix, cache):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_ext.trainer.corpus import gpt_dataset_config

    config = gpt_dataset_config(prefix, SEQ, 1234, cache, create_attention_mask=True)
    return BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()[0]


def _fake_args(dp, consumed):
    """The fields Megatron-LM's parse_args / validate_args / checkpoint loading set, as a Namespace."""
    args = megatron_lm.with_plugin_args()(argparse.ArgumentParser()).parse_args(
        ["--shm-data-loader", "--shm-data-loader-slots", "3", "--shm-data-loader-timeout", "60"]
    )
    fields = dict(
        micro_batch_size=MBS,
        global_batch_size=MBS * dp,
        iteration=consumed // (MBS * dp),
        consumed_train_samples=consumed,
        consumed_valid_samples=MBS * dp,
        dataloader_type="cyclic",
        data_sharding=True,
        create_attention_mask_in_dataloader=True,
        skip_train=False,
        world_size=2,
        data_parallel_size=dp,
        pipeline_model_parallel_size=1,
        spec=None,
    )
    for key, value in fields.items():
        setattr(args, key, value)
    return args


def _hooks_match_loader(prefix, cache, tp, consumed, job):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import RerunDataIterator

    from mdsp_base.installer import Installer
    from megatron_ext.data.config import ShmDataLoaderConfig
    from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
    from megatron_ext.integration.upstream import hooks

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    dataset = _dataset(prefix, cache)
    args = _fake_args(ps.get_data_parallel_world_size(), consumed)
    # Megatron-LM's global args, as pretrain() leaves them (upstream is not installed here).
    fake = types.ModuleType("megatron.training")
    fake.get_args = lambda: args
    sys.modules["megatron.training"] = fake
    os.environ["SLURM_JOB_ID"] = job  # this run's segment names
    try:
        with Installer() as owner, hooks.owning(owner):  # as the launcher holds one around the script
            provider = megatron_lm.DatasetsProvider(lambda sizes: (dataset, dataset, None))
            assert provider.is_distributed and megatron_lm.shm_loader_enabled()
            train, valid, test = provider([40, 40, 0])
            assert test is None and args.dataloader_type == "external"
            wrapped = RerunDataIterator(train)  # what Megatron-LM hands to forward_step
            got = [megatron_lm.get_batch_on_this_tp_rank(wrapped) for _ in range(STEPS)]
            got_valid = [megatron_lm.get_batch_on_this_tp_rank(valid) for _ in range(2)]
            text = megatron_deepspeed.text_batch(["text"], train, torch.int64)
            after = next(train)
            assert [c.owner for c in owner.changes] == ["megatron_ext.data"] * 2  # closed with the run
    finally:
        del sys.modules["megatron.training"], os.environ["SLURM_JOB_ID"]
    kwargs = dict(
        micro_batch_size=MBS,
        config=ShmDataLoaderConfig(enabled=False),
        topology=None,
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        sampler="random",
        create_attention_mask=True,
    )
    stock = build_batch_iterator(dataset, LoaderSettings(consumed_samples=consumed, **kwargs))
    expected = [next(stock) for _ in range(STEPS + 2)]
    stock_valid = build_batch_iterator(
        dataset, LoaderSettings(consumed_samples=args.consumed_valid_samples, **kwargs)
    )
    expected_valid = [next(stock_valid) for _ in range(2)]
    dist.barrier()
    for i, (a, b) in enumerate(zip(got + got_valid, expected[:STEPS] + expected_valid)):
        for key, value in b.items():
            assert torch.equal(a[key], value), f"rank {dist.get_rank()} batch {i} {key} differs"
        assert a["cu_seqlens"] is None and a["max_seqlen"] is None
    assert torch.equal(text["text"][:, :-1], expected[STEPS]["tokens"])
    assert torch.equal(text["text"][:, 1:], expected[STEPS]["labels"])
    assert torch.equal(after["tokens"], expected[STEPS + 1]["tokens"])
    return ps.get_data_parallel_rank()


@pytest.mark.parametrize(("tp", "consumed"), [(2, 0), (1, 12)])
def test_hooks_give_the_loader_batches(run_ranks, corpus, tp, consumed):
    dp_ranks = run_ranks(2, _hooks_match_loader, *corpus, tp, consumed, uuid.uuid4().hex[:10], timeout=180)
    assert dp_ranks == ([0, 0] if tp == 2 else [0, 1])


@contextlib.contextmanager
def _megatron_training(args, config):
    """Stand-ins for the two ``megatron.training`` functions the spec reads (upstream's args and its
    TransformerConfig), installed for the block, removed after; the hooks' changes go through an
    installer of the block's own, as the launcher's in an upstream run."""
    from mdsp_base.installer import Installer
    from megatron_ext.integration.upstream import hooks

    fake, fake_arguments = (
        types.ModuleType("megatron.training"),
        types.ModuleType("megatron.training.arguments"),
    )
    fake.get_args = lambda: args
    fake_arguments.core_transformer_config_from_args = lambda _: config
    sys.modules.update({"megatron.training": fake, "megatron.training.arguments": fake_arguments})
    try:
        with Installer() as owner, hooks.owning(owner):
            yield
    finally:
        del sys.modules["megatron.training"], sys.modules["megatron.training.arguments"]


def _spec_layer_matches_stock(mode):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module, import_module

    from megatron_ext.integration.core_on_cpu import enable_cpu_support
    from megatron_ext.integration.gpt import causal_mask, gpt_config, local_layer_spec
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
    from megatron_ext.layers.norm import SequenceParallelNorm

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    args = megatron_lm.with_plugin_args()(argparse.ArgumentParser()).parse_args(
        ["--flash-overlap", "--flash-overlap-layers", "qkv", "fc2", "--flash-overlap-mode", mode]
    )
    args.world_size, args.data_parallel_size, args.spec = 2, 1, list(megatron_lm.SPEC_FLAG)
    config = gpt_config(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    layers = []
    with _megatron_training(args, config):
        block = import_module(list(args.spec))  # what gpt_builder does with --spec
        assert len(block.layer_specs) == 1 and block.layer_norm is SequenceParallelNorm
        for spec in (block.layer_specs[0], local_layer_spec()):
            torch.manual_seed(3)
            model_parallel_cuda_manual_seed(3)
            layers.append(build_module(spec, config=config, layer_number=1))
    ours, stock = layers
    attention, mlp = ours.self_attention, ours.mlp
    assert (
        isinstance(attention.linear_qkv, FlashOverlapColumnParallelLinear)
        and attention.linear_qkv.p2p_mode == mode
    )
    assert isinstance(mlp.linear_fc2, FlashOverlapRowParallelLinear)
    assert type(attention.linear_proj) is type(stock.self_attention.linear_proj)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(dist.get_rank()))  # [s/tp, b, h]
    mask = causal_mask(16, "cpu")
    out, _ = ours(x.clone().requires_grad_(), attention_mask=mask)
    ref, _ = stock(x.clone().requires_grad_(), attention_mask=mask)
    torch.testing.assert_close(out, ref)
    return True


def test_spec_layer_equals_megatron_core_layer(run_ranks):
    assert run_ranks(2, _spec_layer_matches_stock, "ring", timeout=180) == [True, True]


def _local_block_matches_upstreams_default():
    """Two layers and the final norm as upstream Megatron-LM builds them under
    ``--spec megatron_ext.integration.upstream.megatron_lm local_layer_spec`` and with no --spec (its
    ``_get_transformer_layer_spec``: megatron-core's local layer spec, dense, LayerNorm)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_ext.integration.core_on_cpu import enable_cpu_support
    from megatron_ext.integration.gpt import causal_mask, gpt_config

    enable_cpu_support()
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    args = megatron_lm.with_plugin_args()(argparse.ArgumentParser()).parse_args([])
    args.world_size, args.data_parallel_size = 2, 1
    args.spec = [megatron_lm.SPEC_FLAG[0], "local_layer_spec"]
    config = gpt_config(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = []
    with _megatron_training(args, config):
        for spec in (import_module(args.spec), get_gpt_layer_local_spec(normalization="LayerNorm")):
            torch.manual_seed(3)
            model_parallel_cuda_manual_seed(3)
            block = TransformerBlock(config, spec)
            inp = x.clone().requires_grad_()
            out = block(inp, attention_mask=causal_mask(16, "cpu"))
            out.sum().backward()
            results.append([out.detach(), inp.grad, *(p.grad for p in block.parameters())])
    ours, upstream = results
    assert len(ours) == len(upstream)
    for a, b in zip(ours, upstream):
        torch.testing.assert_close(a, b)
    return True


def test_local_layer_spec_builds_upstreams_default_model(run_ranks):
    """Our baseline block is upstream's model: same output and gradients as what Megatron-LM builds
    without --spec, at TP=2 (the training runs in test_upstream_training use it as their baseline)."""
    assert run_ranks(2, _local_block_matches_upstreams_default, timeout=180) == [True, True]


class _LegacyText:
    """Megatron-DeepSpeed's dataset items ({"text": seq + 1 tokens}), made from a GPTDataset."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        sample = self.dataset[idx]
        return {"text": torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()}


def _megatron_deepspeed_path(prefix, cache, job):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mdsp_base.installer import Installer
    from megatron_ext.data.config import ShmDataLoaderConfig
    from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
    from megatron_ext.integration.upstream import hooks

    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    dataset = _dataset(prefix, cache)
    args = _fake_args(1, 0)
    for key, value in dict(
        deepspeed=True,
        no_pipeline_parallel=True,
        dataloader_type="single",
        train_samples=None,
        eval_interval=10,
        eval_iters=0,
        train_iters=STEPS,
        seq_length=SEQ,
    ).items():
        setattr(args, key, value)
    order = []

    def build_train_valid_test_datasets(provider):  # Megatron-DeepSpeed's: sizes from args, then the provider
        order.append(ps.get_tensor_model_parallel_rank())
        return provider([STEPS * MBS, 0, 0])

    fake = types.ModuleType("megatron.training")
    fake.get_args, fake.build_train_valid_test_datasets = (lambda: args), build_train_valid_test_datasets
    sys.modules["megatron.training"] = fake
    os.environ["SLURM_JOB_ID"] = job
    try:
        assert megatron_lm.shm_loader_enabled()
        with Installer() as owner, hooks.owning(owner):  # as the launcher holds one around the script
            train, valid, test = megatron_deepspeed.data_iterators(
                lambda sizes: (_LegacyText(dataset), None, None)
            )
            rows = [megatron_deepspeed.text_batch(["text"], train, torch.int64)["text"] for _ in range(STEPS)]
            assert [c.owner for c in owner.changes] == ["megatron_ext.data"]  # the loader ends with the run
    finally:
        del sys.modules["megatron.training"], os.environ["SLURM_JOB_ID"]
    assert (valid, test, args.do_train, args.do_valid) == (None, None, True, False)
    stock = build_batch_iterator(
        dataset,
        LoaderSettings(
            micro_batch_size=MBS,
            consumed_samples=0,
            config=ShmDataLoaderConfig(),
            topology=None,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_rank=0,
            dp_size=1,
        ),
    )
    for i, row in enumerate(rows):
        expected = next(stock)
        assert torch.equal(row, torch.cat([expected["tokens"], expected["labels"][:, -1:]], dim=1)), (
            f"batch {i}"
        )
    dist.barrier()
    return order


def test_megatron_deepspeed_hooks_give_the_loader_batches(run_ranks, corpus):
    assert run_ranks(2, _megatron_deepspeed_path, *corpus, uuid.uuid4().hex[:10], timeout=180) == [[0], [1]]
