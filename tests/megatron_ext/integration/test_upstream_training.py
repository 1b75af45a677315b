"""Upstream pretrain_gpt.py (Megatron-LM core_v0.16.1, Megatron-DeepSpeed 4efb479) trains on CPU
through ``python -m megatron_ext.launch`` on 4 gloo ranks: TP=2 x DP=2 unpatched,
patched with the plugins off (Megatron-LM) and with all of its plugins on at once, (Megatron-LM)
the node loader under pipeline parallelism at TP=1 x PP=2 x DP=2 (the other PP layouts are
compared with Megatron's stock batches in process, test_shm_pipeline.py), and (Megatron-DeepSpeed)
Ulysses at SP=2 x DP=2 under ZeRO-3, stock DistributedAttention against Flash-Overlap's (GQA at
SP=2 on 2 ranks, against SP=1). With dropout 0 every run must print its baseline's ``lm loss`` at
every iteration, and each plugin run must log exactly its plugins enabled. A plugin is not run alone here: it is exact alone in the
faster tests of its own (test_shm_loader, test_flash_overlap, test_hierarchical_zero) and together
with the others here.

The ranks are forked from one warm interpreter (``multirank.warm``) with torchrun's variables: under
torchrun a run spends ~20 of its ~30 s on 2 cores importing torch, DeepSpeed and Megatron in 4
processes at once, and ~4 s more finalizing them. One run is launched by torchrun too, and must print
what its warm launch printed (``test_torchrun_prints_the_losses_and_plugins_of_the_warm_launch``;
for Megatron-LM the Slurm test compares srun's ranks the same way).

Trees and data: tests/helpers/upstream.py (../shared/upstream/, a cache outside the project). Where
CI=true a missing prerequisite fails the tests; elsewhere it skips them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from multirank import free_port
from multirank.warm import WarmLauncher
from tests.helpers.early import take
from tests.helpers.slurm import LAUNCHER_PARAMS, LOCAL_SBATCH, wait_for_job
from tests.helpers.upstream import SetupError, Tree, prepare, tool_env
from tests.helpers.upstream_warm import FIXTURE, launcher, rank_env

pytestmark = pytest.mark.upstream

ITERS = 3
RUN_TIMEOUT_S = 300
LOSS = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?\| lm loss: ([0-9.E+-]+) \|")
PLUGIN_CONFIG = re.compile(r"plugin config: (\{.*\})")
UNDONE = re.compile(r"undoing the run's process-wide changes, newest first: (.*)")
# the module that owns each plugin's process-wide changes in an upstream run
OWNERS = {
    "shm_data_loader": "megatron_ext.data",
    "hierarchical_zero": "deepspeed_ext.zero",
    "flash_overlap": "megatron_ext.layers",
}
COMMON = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--train-iters",
    str(ITERS),
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "constant",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "256",
    "--split",
    "100,0,0",
    "--no-gradient-accumulation-fusion",
    "--num-workers",
    "0",
]
TP2 = ["--tensor-model-parallel-size", "2"]
# Megatron-LM without Apex or Transformer Engine: torch layers, no fused CUDA kernels.
MEGATRON_LM = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--distributed-backend",
    "gloo",
    "--use-cpu-initialization",
    "--transformer-impl",
    "local",
    "--no-persist-layer-norm",
    "--no-bias-dropout-fusion",
    "--no-bias-gelu-fusion",
    "--no-masked-softmax-fusion",
]
# Sequence parallelism through our block (upstream's own local spec refuses it without Apex/TE).
LOCAL_SPEC = [
    "--spec",
    "megatron_ext.integration.upstream.megatron_lm",
    "local_layer_spec",
    "--sequence-parallel",
]
FLASH = [
    "--spec",
    "megatron_ext.integration.upstream.megatron_lm",
    "flash_overlap_layer_spec",
    "--sequence-parallel",
    "--flash-overlap",
]
PP2 = ["--pipeline-model-parallel-size", "2"]
SP2 = ["--ds-sequence-parallel-size", "2"]
ULYSSES = "flash_overlap: Ulysses attention with overlapped all-to-alls over 2 ranks"
# Megatron's, over the TP group; rotary positions (the tree's learned ones are per-TP-rank slices at SP)
SEQUENCE_PARALLEL = ["--sequence-parallel", "--use-rotary-position-embeddings"]
TP_LINEARS = (
    "flash_overlap: TP/SP linears overlapped over 2 ranks (direct P2P) in each transformer layer: "
    "attention.query_key_value (qkv), attention.dense (proj), mlp.dense_h_to_4h (fc1), mlp.dense_4h_to_h (fc2)"
)
GQA = ["--num-key-value-heads", "2"]
TEN = ("--train-iters", "10")
ROPE = ["--use-rotary-position-embeddings"]
# Megatron-DeepSpeed: ZeRO-3 needs --no-pipeline-parallel; micro batch 1 but where a variant says
# (the unpatched tree's non-flash attention needs micro batch 1; the patch's QKV split lifts that).
# Weight decay stays at the tree's default (0.01): hierarchical ZeRO builds under zero.Init as stock does.
DEEPSPEED = ["--global-batch-size", "4", "--deepspeed", "--no-pipeline-parallel"]
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "zero_optimization": {"stage": 3},
    "steps_per_print": 1000,
}


def save(name: str) -> tuple[str, ...]:
    """Flags that save the run's last iteration to ``{work}/ckpt-<name>``."""
    return ("--save", f"{{work}}/ckpt-{name}", "--save-interval", str(ITERS))


def resume(name: str) -> tuple[str, ...]:
    """Flags that load ``{work}/ckpt-<name>`` and train one iteration more (the schedule from the
    flags: the checkpoint's holds the shorter run's length)."""
    return (
        "--load",
        f"{{work}}/ckpt-{name}",
        "--train-iters",
        str(ITERS + 1),
        "--override-opt_param-scheduler",
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    patched: bool
    flags: tuple[str, ...]
    plugins: tuple[str, ...] = ()  # the plugins its log must show enabled
    baseline: str | None = "unpatched"  # the run whose losses it must print; None: a baseline itself
    logs: tuple[str, ...] = ()  # lines its log must hold: each plugin's own path ran
    nodes: int = 1  # torchrun launches (one per emulated node) sharing the ranks
    accumulation: int = 2  # gradient accumulation: global batch 4 = micro batch x accumulation x DP
    micro_batch: int = 1  # Megatron-DeepSpeed's --micro-batch-size
    ranks: int = 4  # gloo ranks of the run
    rtol: float = 0.0  # losses agree to this relative difference (0: the baseline's printed losses exactly)
    zero_stage: int = 3  # Megatron-DeepSpeed's ZeRO stage
    clipping: float = 1.0  # the JSON's gradient_clipping (1.0: DeepSpeed's default)
    iters: int = ITERS  # iterations it trains (the flags' --train-iters where not ITERS)


# (upstream, variant) -> how it runs; 4 ranks each but GQA's (the head split needs no DP)
VARIANTS = {
    # TP=2 x DP=2 with sequence parallelism
    ("megatron-lm", "unpatched"): Variant(False, (*TP2, *LOCAL_SPEC), baseline=None),
    ("megatron-lm", "patched-off"): Variant(True, (*TP2, *LOCAL_SPEC)),
    ("megatron-lm", "both"): Variant(
        True, (*TP2, *FLASH, "--shm-data-loader"), ("flash_overlap", "shm_data_loader")
    ),
    # pipeline parallelism end to end at TP=1 x PP=2 x DP=2 (TP=2 x PP=2 and PP=4 are compared with
    # Megatron's stock batches in process: test_shm_pipeline.py)
    ("megatron-lm", "pp2-dp2-unpatched"): Variant(False, tuple(PP2), baseline=None),
    ("megatron-lm", "pp2-dp2-shm-data-loader"): Variant(
        True, (*PP2, "--shm-data-loader"), ("shm_data_loader",), "pp2-dp2-unpatched"
    ),
    # TP=2 x DP=2, ZeRO-3
    ("megatron-deepspeed", "unpatched"): Variant(False, tuple(TP2), baseline=None),
    ("megatron-deepspeed", "both"): Variant(
        True, (*TP2, "--shm-data-loader", "--hierarchical-zero"), ("shm_data_loader", "hierarchical_zero")
    ),
    # Megatron's sequence parallelism at TP=2 x DP=2 (ZeRO stages 3 and 1). The tree cannot run it
    # unpatched (its get_batch cuts the sequence that the embedding then cuts again: "The size of tensor
    # a (32) must match the size of tensor b (64)"), and under DeepSpeed nothing sums the norms' and
    # row biases' gradients over TP; the patch mends both, so every run prints TP=2's losses without it.
    ("megatron-deepspeed", "tp2-rope"): Variant(False, (*TP2, *ROPE), baseline=None),
    ("megatron-deepspeed", "tp2-sp-patched-off"): Variant(
        True, (*TP2, *SEQUENCE_PARALLEL, *save("tp2-sp")), baseline="tp2-rope", rtol=1e-6
    ),
    # Flash-Overlap's TP/SP linears
    ("megatron-deepspeed", "tp2-sp-flash-overlap"): Variant(
        True,
        (*TP2, *SEQUENCE_PARALLEL, "--flash-overlap", *save("tp2-sp-flash-overlap")),
        ("flash_overlap",),
        "tp2-rope",
        (TP_LINEARS,),
        rtol=1e-6,
    ),
    ("megatron-deepspeed", "tp2-sp-hierarchical-zero-flash-overlap"): Variant(
        True,
        (*TP2, *SEQUENCE_PARALLEL, "--hierarchical-zero", "--flash-overlap"),
        ("hierarchical_zero", "flash_overlap"),
        "tp2-rope",
        (TP_LINEARS,),
        nodes=2,
        rtol=1e-6,
    ),
    # micro batch 2: the tree's CoreAttention views q, k and v with batch and heads merged, which the
    # strided thirds of its fused QKV output allow only at micro batch 1 ("view size is not compatible
    # with input tensor's size and stride", with or without sequence parallelism); the patch's split
    # hands it contiguous parts, and sequence parallelism prints TP=2's losses at micro batch 2 too.
    ("megatron-deepspeed", "tp2-rope-mbs2"): Variant(
        True, (*TP2, *ROPE), baseline=None, accumulation=1, micro_batch=2
    ),
    ("megatron-deepspeed", "tp2-sp-mbs2"): Variant(
        True, (*TP2, *SEQUENCE_PARALLEL), baseline="tp2-rope-mbs2", accumulation=1, micro_batch=2, rtol=1e-6
    ),
    ("megatron-deepspeed", "tp2-rope-zero1"): Variant(False, (*TP2, *ROPE), baseline=None, zero_stage=1),
    ("megatron-deepspeed", "tp2-sp-zero1-flash-overlap"): Variant(
        True,
        (*TP2, *SEQUENCE_PARALLEL, "--flash-overlap"),
        ("flash_overlap",),
        "tp2-rope-zero1",
        (TP_LINEARS,),
        zero_stage=1,
        rtol=1e-6,
    ),
    # Ulysses SP=2 x DP=2: stock DistributedAttention needs the patch's call fix to run at all (the
    # unpatched tree fails in its first forward), so the baseline is the patched tree, plugins off.
    # Every Ulysses run and its SP=1 reference runs without gradient clipping: DeepSpeed's ZeRO-3 hands
    # the optimizer 1/SP of SP=1's gradient (stock and ours alike), so its default clipping at 1.0 clips
    # an SP=1 run where it leaves SP=2 alone (norms 1.43 and 0.72 here), and the two would train apart.
    ("megatron-deepspeed", "sp2-patched-off"): Variant(True, tuple(SP2), baseline=None, clipping=0.0),
    # both plugins at once (each alone: test_ulysses.py against DistributedAttention, test_hierarchical_zero.py
    # against stock ZeRO-3): stock partitions and reduces over sequence x data parallel ranks, the levels too
    ("megatron-deepspeed", "sp2-hierarchical-zero-flash-overlap"): Variant(
        True,
        (*SP2, "--hierarchical-zero", "--flash-overlap"),
        ("hierarchical_zero", "flash_overlap"),
        "sp2-patched-off",
        ("hierarchical ZeRO: DP group 4 = 2 node(s)", ULYSSES),
        nodes=2,
        clipping=0.0,
    ),
    # With clipping on (DeepSpeed's default 1.0, which clips SP=1 here and would leave SP=2 alone),
    # hierarchical ZeRO's sequence_parallel_gradients=mean hands the optimizer SP=1's gradient: SP=2
    # prints SP=1's losses (the 4 ranks as DP, same global batch) to SP's rounding. Over 10
    # iterations: stock's 1/SP gradient drifts to 1.6e-4 relative by iteration 8.
    ("megatron-deepspeed", "dp4-10-iterations"): Variant(True, TEN, baseline=None, accumulation=1, iters=10),
    ("megatron-deepspeed", "sp2-10-iterations"): Variant(True, (*SP2, *TEN), baseline=None, iters=10),
    ("megatron-deepspeed", "sp2-hierarchical-zero-mean"): Variant(
        True,
        (*SP2, *TEN, "--hierarchical-zero", "--hierarchical-zero-sequence-parallel-gradients", "mean"),
        ("hierarchical_zero",),
        "dp4-10-iterations",
        ("hierarchical_zero.sequence_parallel_gradients=mean: the optimizer gets SP=1's gradient",),
        nodes=2,
        rtol=1e-6,
        iters=10,
    ),
    # GQA (4 query heads, 2 key/value heads) on 2 ranks: stock Ulysses asserts against it, so the
    # reference is the same model at SP=1 with the 2 ranks as DP (same global batch), on the patched
    # tree, whose fused-QKV split the patch fixes for GQA. SP=2 sums each gradient over other ranks in
    # another order than SP=1 (and Adam sees half of it): rounding, 1e-6 relative on the loss.
    ("megatron-deepspeed", "gqa-dp2"): Variant(True, tuple(GQA), baseline=None, ranks=2, clipping=0.0),
    ("megatron-deepspeed", "sp2-gqa-flash-overlap"): Variant(
        True,
        (*SP2, *GQA, "--flash-overlap"),
        ("flash_overlap",),
        "gqa-dp2",
        (ULYSSES,),
        accumulation=4,
        ranks=2,
        rtol=1e-6,
        clipping=0.0,
    ),
    # A Llama-like attention: GQA with rotary embeddings. Stock Ulysses drops RoPE on this (non-flash)
    # path (iteration 1 at 4 ranks: 5.972702 against SP=1's 5.972714), so the reference is SP=1 again.
    ("megatron-deepspeed", "gqa-rope-dp2"): Variant(
        True, (*GQA, *ROPE), baseline=None, ranks=2, clipping=0.0
    ),
    ("megatron-deepspeed", "sp2-gqa-rope-flash-overlap"): Variant(
        True,
        (*SP2, *GQA, *ROPE, "--flash-overlap"),
        ("flash_overlap",),
        "gqa-rope-dp2",
        (ULYSSES,),
        accumulation=4,
        ranks=2,
        rtol=1e-6,
        clipping=0.0,
    ),
}
# A checkpoint of either TP/SP run loads into the other: one more iteration each way
RESUMED = {
    ("megatron-deepspeed", "tp2-sp-flash-overlap-from-patched-off"): Variant(
        True, (*TP2, *SEQUENCE_PARALLEL, "--flash-overlap", *resume("tp2-sp")), ("flash_overlap",), None
    ),
    ("megatron-deepspeed", "tp2-sp-patched-off-from-flash-overlap"): Variant(
        True, (*TP2, *SEQUENCE_PARALLEL, *resume("tp2-sp-flash-overlap")), baseline=None
    ),
}
_runs: dict[tuple[str, str], tuple[list[tuple[int, str]], str]] = {}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tree]:
    try:
        trees = prepare()
    except SetupError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"upstream training tests cannot run in CI: {exc}")
        pytest.skip(f"upstream training tests need: {exc}")
    trees["work"] = tmp_path_factory.mktemp("upstream-runs")  # type: ignore[assignment]
    return trees


@pytest.fixture(scope="module")
def upstream_warm(request: pytest.FixtureRequest, upstream: dict) -> Iterator[WarmLauncher]:
    """The ranks' launcher (``tests.helpers.upstream_warm``): forked from one interpreter that has
    imported what both trees import; torchrun's variables."""
    with take(request.config, FIXTURE, lambda: launcher(upstream, upstream["work"])) as warm:
        yield warm


def _argv(tree: Tree, kind: str, how: Variant, work: Path) -> list[str]:
    """What each rank runs: the launcher, the tree's pretrain_gpt.py and the variant's flags."""
    cmd = [
        "-m",
        "megatron_ext.launch",
        str((tree.patched if how.patched else tree.pristine) / "pretrain_gpt.py"),
        *COMMON,
        "--data-path",
        tree.data,
        "--data-cache-path",
        str(work / f"index-{kind}"),
    ]
    flags = [flag.replace("{work}", str(work)) for flag in how.flags]
    if kind == "megatron-lm":
        return cmd + MEGATRON_LM + flags
    ds = {
        **DS_CONFIG,
        "train_micro_batch_size_per_gpu": how.micro_batch,
        "gradient_accumulation_steps": how.accumulation,
        "zero_optimization": {"stage": how.zero_stage},
        "gradient_clipping": how.clipping,
    }
    config = work / f"ds_config_{how.micro_batch}_{how.accumulation}_{how.zero_stage}_{how.clipping}.json"
    config.write_text(json.dumps(ds))
    stage = ["--micro-batch-size", str(how.micro_batch), "--zero-stage", str(how.zero_stage)]
    return cmd + DEEPSPEED + stage + ["--deepspeed_config", str(config)] + flags


def _train(upstream: dict, warm: WarmLauncher, kind: str, variant: str) -> tuple[list[tuple[int, str]], str]:
    if (kind, variant) in _runs:
        return _runs[(kind, variant)]
    how = {**VARIANTS, **RESUMED}[(kind, variant)]
    work, port = upstream["work"], free_port()
    log = work / f"{kind}-{variant}.log"
    try:
        codes = warm.launch(
            _argv(upstream[kind], kind, how, work),
            work,
            log,
            how.nodes,
            how.ranks // how.nodes,
            port,
            RUN_TIMEOUT_S,
        )
    except TimeoutError as exc:
        pytest.fail(f"{kind} {variant}: {exc}")
    finally:
        _remove_shm_buffers(port)
    output = log.read_text(errors="replace")
    assert not any(codes), f"{kind} {variant} exited {codes}; output ends:\n{output[-6000:]}"
    _runs[(kind, variant)] = (_losses(output), output)
    print(f"{kind} {variant}: lm loss {[loss for _, loss in _runs[(kind, variant)][0]]}")
    return _runs[(kind, variant)]


def _losses(log: str) -> list[tuple[int, str]]:
    return sorted({int(it): loss for it, _, loss in LOSS.findall(log)}.items())


def _remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU all-reduce leaves a buffer per rank in /dev/shm, named after the port."""
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        leftover.unlink(missing_ok=True)


def _torchrun(upstream: dict, kind: str, variant: str) -> tuple[list[int], str]:
    """``variant`` launched as a user launches it: one torchrun per node; exit codes and output."""
    how, work, port = VARIANTS[(kind, variant)], upstream["work"], free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(how.nodes)]
    torchrun += [
        "--nproc-per-node",
        str(how.ranks // how.nodes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    argv = _argv(upstream[kind], kind, how, work)
    agents = [
        subprocess.Popen(
            [*torchrun, "--node-rank", str(node), *argv],
            cwd=work,
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream in time order: a failure's tail shows what came before it
            text=True,
        )
        for node in range(how.nodes)
    ]
    logs, codes = [], []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=RUN_TIMEOUT_S)[0])
            codes.append(agent.returncode)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{kind} {variant} under torchrun did not finish in {RUN_TIMEOUT_S}s")
    finally:
        for agent in agents:
            agent.kill()
        _remove_shm_buffers(port)
    return codes, "\n".join(logs)


@pytest.mark.parametrize(
    ("kind", "variant"),
    [key for key, how in VARIANTS.items() if how.baseline is None],
)
def test_baseline_upstream_runs_train_on_cpu(
    upstream: dict, upstream_warm: WarmLauncher, kind: str, variant: str
) -> None:
    losses, log = _train(upstream, upstream_warm, kind, variant)
    assert [it for it, _ in losses] == list(range(1, VARIANTS[(kind, variant)].iters + 1)), (
        f"no lm loss for every iteration:\n{log[-4000:]}"
    )
    assert float(losses[-1][1]) < float(losses[0][1]), f"loss did not fall: {losses}"


def _check_plugins(kind: str, variant: str, log: str) -> None:
    """The run's log shows exactly its plugins enabled, its own path taken, and every rank's undo."""
    how = VARIANTS[(kind, variant)]
    configs = [json.loads(m) for m in PLUGIN_CONFIG.findall(log)]
    if how.plugins:
        assert configs, f"{kind} {variant}: no 'plugin config:' line logged"
    for config in configs:
        for plugin in ("shm_data_loader", "hierarchical_zero", "flash_overlap"):
            assert config[plugin]["enabled"] == (plugin in how.plugins), (plugin, config)
    for line in how.logs:
        assert line in log, f"{kind} {variant}: no {line!r} in its log"
    # the run exited 0, so every undo ran without error; each plugin's changes were among them
    undone = UNDONE.findall(log)
    assert len(undone) == how.ranks, (
        f"{kind} {variant}: {len(undone)} of {how.ranks} ranks undid their changes:\n{log[-2500:]}"
    )
    for plugin in how.plugins:
        assert all(f"{OWNERS[plugin]}: " in line for line in undone), (plugin, undone[0])


@pytest.mark.parametrize(
    ("kind", "variant"), [key for key, how in VARIANTS.items() if how.baseline is not None]
)
def test_upstream_with_plugins_prints_the_baseline_losses(
    upstream: dict, upstream_warm: WarmLauncher, kind: str, variant: str
) -> None:
    how = VARIANTS[(kind, variant)]
    baseline, _ = _train(upstream, upstream_warm, kind, how.baseline)
    losses, log = _train(upstream, upstream_warm, kind, variant)
    _check_plugins(kind, variant, log)
    assert len(baseline) == how.iters and [it for it, _ in losses] == [it for it, _ in baseline], (
        losses,
        baseline,
    )
    for (_, got), (_, want) in zip(losses, baseline):
        assert got == want if not how.rtol else abs(float(got) / float(want) - 1) <= how.rtol, (
            f"{kind} {variant}: {losses} != {how.baseline} {baseline}"
        )


def test_torchrun_prints_the_losses_and_plugins_of_the_warm_launch(
    upstream: dict, upstream_warm: WarmLauncher
) -> None:
    """The other tests fork their ranks from a warm interpreter; here torchrun starts them as a user
    does (two agents, one per emulated node, every plugin of the tree on but the loader): every rank
    exits 0 and prints what the warm launch printed. The Slurm test does the same for Megatron-LM."""
    kind, variant = "megatron-deepspeed", "tp2-sp-hierarchical-zero-flash-overlap"
    expected, _ = _train(upstream, upstream_warm, kind, variant)
    codes, log = _torchrun(upstream, kind, variant)
    assert codes == [0, 0], f"torchrun exited {codes}; output ends:\n{log[-6000:]}"
    _check_plugins(kind, variant, log)
    assert _losses(log) == expected, f"torchrun {_losses(log)} != warm {expected}"


def _layout(value: object) -> object:
    """A checkpoint's structure: its keys, and each tensor's shape and dtype (values aside)."""
    import torch

    if isinstance(value, dict):
        return {key: _layout(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_layout(item) for item in value]
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return type(value).__name__


def test_megatron_deepspeed_checkpoints_load_with_and_without_flash_overlap(
    upstream: dict, upstream_warm: WarmLauncher
) -> None:
    import torch

    kind = "megatron-deepspeed"
    for variant in ("tp2-sp-patched-off", "tp2-sp-flash-overlap"):
        _train(upstream, upstream_warm, kind, variant)
    stock, ours = (
        upstream["work"] / f"ckpt-{name}" / f"global_step{ITERS}"
        for name in ("tp2-sp", "tp2-sp-flash-overlap")
    )
    files = sorted(path.name for path in stock.iterdir())
    assert files == sorted(path.name for path in ours.iterdir()) and any(
        "model_states" in f for f in files
    ), files
    for name in files:
        saved = [torch.load(d / name, map_location="cpu", weights_only=False) for d in (stock, ours)]
        assert _layout(saved[0]) == _layout(saved[1]), name
    # each loads into the other's model and trains on: iteration 4 agrees to rounding
    resumed = [_train(upstream, upstream_warm, kind, variant)[0] for variant in (v for _, v in RESUMED)]
    assert [it for it, _ in resumed[0]] == [it for it, _ in resumed[1]] == [ITERS + 1], resumed
    (_, a), (_, b) = resumed[0][0], resumed[1][0]
    assert abs(float(a) / float(b) - 1) <= 1e-6, resumed


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm")
def test_local_sbatch_runs_upstream_megatron_lm(
    upstream: dict, upstream_warm: WarmLauncher, tmp_path: Path
) -> None:
    """``UPSTREAM_DIR=<patched Megatron-LM> sbatch scripts/slurm/local.sbatch``: srun starts the 4 ranks
    through the launcher, and they print the losses torchrun's ranks printed with the same flags."""
    expected, _ = _train(upstream, upstream_warm, "megatron-lm", "both")
    tree, work = upstream["megatron-lm"], upstream["work"]
    flags = [
        *COMMON,
        *MEGATRON_LM,
        *VARIANTS[("megatron-lm", "both")].flags,
        "--data-cache-path",
        str(work / "index-megatron-lm"),
    ]
    model = tmp_path / "flags.args"
    model.write_text("\n".join(flags) + "\n")
    log_file = tmp_path / "job.out"
    env = {k: v for k, v in tool_env().items() if k not in LAUNCHER_PARAMS}
    env.update(
        UPSTREAM_DIR=str(tree.patched),
        MODEL=str(model),
        DATA_PATH=tree.data,
        DRY_RUN="0",
        TRAIN_PYTHON=sys.executable,
    )
    sub = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks=4",
            "--nodes=1",
            f"--output={log_file}",
            f"--chdir={tmp_path}",
            "--job-name=test-upstream-local",
            f"--time={RUN_TIMEOUT_S // 60 + 2}",
            str(LOCAL_SBATCH),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert sub.returncode == 0, f"sbatch failed ({sub.returncode}): {sub.stderr.strip()}"
    job_id = sub.stdout.strip().split(";")[0]
    state, code, problem = wait_for_job(job_id, RUN_TIMEOUT_S, 300)
    log = log_file.read_text(errors="replace") if log_file.exists() else "<no log file>"
    assert not problem and state == "COMPLETED" and code.startswith("0:"), (
        f"job {job_id}: {problem or state} exit {code}; log ends:\n{log[-4000:]}"
    )
    assert "-m megatron_ext.launch" in log, "the plan printed by the script names the launcher"
    losses = _losses(log)
    assert losses == expected, f"srun {losses} != torchrun {expected}"
