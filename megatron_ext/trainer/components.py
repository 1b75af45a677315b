"""The main job's set-up steps: process groups, DeepSpeed config, data, model and engine.

Each step validates its own inputs and raises :class:`UsageError` with a one-line message that
names the flag, the value and the fix (:func:`megatron_ext.trainer.main.main` prints it and exits 2), and makes
its process-wide changes through the job's :class:`~mdsp_base.installer.Installer`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from deepspeed_ext.zero.engine.hierarchical_plan import HierarchicalPlan
from mdsp_base.comm import CommCounter, patch_deepspeed_comm, unpatch_deepspeed_comm
from mdsp_base.installer import Installer
from mdsp_base.topology import Topology
from megatron_ext.integration import transport
from megatron_ext.integration.plugin_config import PluginConfig
from megatron_ext.trainer.checks import env_int
from megatron_ext.trainer.usage_error import UsageError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.utils.tensorboard import SummaryWriter

    from megatron_ext.data.batch import BatchIterator
    from megatron_ext.trainer.corpus import Tokenizer


def init_distributed(world: int, installer: Installer) -> int:
    """Join the job's process group of ``world`` ranks (torchrun or srun variables; a lone process
    otherwise); returns this rank."""
    rank = env_int("RANK", "SLURM_PROCID", default=0)
    local = env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    _set_env(installer, "LOCAL_RANK", str(local))
    if torch.cuda.is_available():
        torch.cuda.set_device(local % torch.cuda.device_count())
        backend = "nccl"
    else:
        backend = "gloo"
    checks_transport = transport.capture_init_log(installer)  # NCCL's init log, read below
    if world == 1 and "MASTER_ADDR" not in os.environ:
        folder = tempfile.mkdtemp(prefix="pretrain-gpt-")
        installer.add(
            "megatron_ext.trainer",
            "a lone process's rendezvous folder in the temporary directory (removed)",
            lambda: shutil.rmtree(folder, ignore_errors=True),
        )
        init = f"file://{folder}/rendezvous"
    else:
        if "MASTER_ADDR" not in os.environ:
            raise UsageError(
                f"world size {world} but MASTER_ADDR is not set: launch with torchrun or the Slurm scripts"
            )
        _set_env(installer, "MASTER_PORT", "29500")
        init = "env://"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    installer.add(
        "megatron_ext.trainer",
        "the job's process group (gloo on CPU, NCCL on GPUs)",
        dist.destroy_process_group,
    )
    if checks_transport:  # sockets across nodes beside a high-speed network: one line, before the model
        transport.check_transport()
    return rank


def _set_env(installer: Installer, name: str, value: str) -> None:
    """``name`` set to ``value`` for the job when the environment does not set it."""
    if name not in os.environ:
        installer.setenv(
            "megatron_ext.trainer", "LOCAL_RANK and MASTER_PORT, where the launch sets none", name, value
        )


def build_model(
    args: argparse.Namespace,
    plugins: PluginConfig,
    tokenizer: Tokenizer,
    topology: Topology,
    ds_config: dict[str, object],
    installer: Installer,
) -> tuple[torch.nn.Module, HierarchicalPlan | None]:
    """GPTModel with megatron-core's local layers, or the Flash-Overlap ones when enabled (the
    topology lets their ``backend: auto`` check that the TP group sits in one node). With
    hierarchical ZeRO it is built partitioned, each module as it is made: no rank holds it whole;
    the plan it is partitioned on comes with it (None without the variant), for :func:`build_engine`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.integration.core_on_cpu import disable_cpu_support, enable_cpu_support
    from megatron_ext.integration.gpt import build_gpt_model, gpt_config, padded_vocab_size
    from megatron_ext.layers.sequence_parallel import allreduce_sequence_parallel_grads

    if enable_cpu_support():
        installer.add(
            "megatron_ext.integration.core_on_cpu",
            "megatron-core's CUDA device and RNG calls on the CPU",
            disable_cpu_support,
        )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    sequence_parallel = args.sequence_parallel or plugins.flash_overlap.enabled
    config = gpt_config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=sequence_parallel,
        bf16=args.bf16,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    layer_spec = None
    if plugins.flash_overlap.enabled and args.tensor_model_parallel_size == 1 and dist.get_rank() == 0:
        print(
            "warning: flash_overlap is on at --tensor-model-parallel-size 1: there is no tensor-parallel "
            "collective to overlap, so it changes nothing; raise the TP size, or switch it off (--no-flash-overlap)",
            file=sys.stderr,
            flush=True,
        )
    if plugins.flash_overlap.enabled:
        from megatron_ext.layers.p2p.link import shutdown_posters
        from megatron_ext.layers.spec import get_flash_overlap_layer_spec

        layer_spec = get_flash_overlap_layer_spec(plugins.flash_overlap, topology=topology)
        installer.add("megatron_ext.layers", "the P2P poster thread (gloo)", shutdown_posters)
    vocab = padded_vocab_size(
        tokenizer.vocab_size, args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    )

    def build() -> torch.nn.Module:
        return build_gpt_model(config, vocab, args.max_position_embeddings, layer_spec)

    plan = None
    if plugins.hierarchical_zero.enabled:
        from megatron_ext.integration.mpu import MegatronMPU
        from megatron_ext.integration.partitioned_build import hierarchical_init

        with hierarchical_init(build, ds_config, plugins, MegatronMPU(), installer, topology) as plan:
            model = build()
    else:
        model = build()
    allreduce_sequence_parallel_grads(model, ps.get_tensor_model_parallel_group())
    if torch.cuda.is_available():
        model.cuda()
    return model, plan


def build_engine(
    args: argparse.Namespace,
    model: torch.nn.Module,
    plan: HierarchicalPlan | None,
    ds_config: dict[str, object],
    plugins: PluginConfig,
    topology: Topology,
    lr_factor: Callable[[int], float],
    installer: Installer,
) -> DeepSpeedEngine:
    """The DeepSpeed engine (the hierarchical ZeRO-3 variant when enabled, on ``plan``: the plan
    the model was built partitioned on), destroyed when ``installer`` closes."""
    from deepspeed_ext.zero import initialize
    from megatron_ext.integration.mpu import MegatronMPU

    def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    engine, *_ = initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
        mpu=MegatronMPU(),
        lr_scheduler=scheduler,
        plugin_config=plugins,
        topology=topology,
        plan=plan,
        installer=installer,
    )
    return engine


def comm_counter(topology: Topology, installer: Installer) -> CommCounter:
    """A counter of DeepSpeed's collectives per link class (package, node, inter-node)."""
    if patch_deepspeed_comm():
        installer.add(
            "mdsp_base.comm",
            "DeepSpeed's backend collectives wrapped to count bytes",
            unpatch_deepspeed_comm,
        )
    return CommCounter(topology)


def plugin_figures(data: BatchIterator, counter: CommCounter) -> dict[str, float]:
    """Figures of the plugins for the log line, this rank's view: time blocked on the loader and bytes
    the node's reader took from storage (both since the start), DeepSpeed's bytes sent per link
    class (this iteration)."""
    figures = {
        "data_wait_s_total": round(data.counters.wait_s, 4),
        "storage_MB_read_total": round(data.counters.bytes_read / 1e6, 3),
    }
    figures.update({f"zero_MB_{link}": round(n / 1e6, 3) for link, n in counter.per_link().items()})
    return figures


def tensorboard_writer(args: argparse.Namespace, rank: int, installer: Installer) -> SummaryWriter | None:
    """Megatron's ``--tensorboard-dir``: on rank 0 a writer of each iteration's figures as scalars
    (closed, with its flush thread, by the installer); None without the flag or on other ranks."""
    if not args.tensorboard_dir or rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(
            "--tensorboard-dir needs the tensorboard package: pip install tensorboard, or drop the flag"
        ) from None
    writer = SummaryWriter(log_dir=args.tensorboard_dir)
    installer.add("megatron_ext.trainer", "a TensorBoard writer and its flush thread", writer.close)
    return writer
