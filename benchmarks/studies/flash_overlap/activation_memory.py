"""Activation memory of the Flash-Overlap backends: the bytes each rank's autograd keeps for backward
after one forward of the main job's GPT at TP=N, by linear slot, for megatron-core's local layers,
the p2p backend and the symm_mem backend.

  python -m benchmarks.studies.flash_overlap.activation_memory                 # tiny-cpu preset, TP=2
  python -m benchmarks.studies.flash_overlap.activation_memory --hidden 2048 --heads 16 --seq 2048 --batch 1 --layers 1

Method in full: benchmarks/results/methods.md, `benchmarks.studies.flash_overlap.activation_memory`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mdsp_base.shutdown import exit_without_teardown

REPO_ROOT = Path(__file__).resolve().parents[3]
RANK_MODULE = ["-m", "benchmarks.studies.flash_overlap.activation_memory"]
SLOTS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
BACKENDS = ("megatron_core", "p2p", "symm_mem")


@contextmanager
def saved_bytes(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """Bytes of the distinct storages autograd saves for backward while the block runs, by the slot
    of :data:`SLOTS` whose forward saved them, else ``other``; the model's parameters are excluded
    (they are held whether or not backward follows)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counted: set[int] = set()
    totals: dict[str, int] = defaultdict(int)
    inside = ["other"]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in counted:
            counted.add(storage.data_ptr())
            totals[inside[-1]] += storage.nbytes()
        return tensor

    def leave(_module: torch.nn.Module, _args: Any, _output: Any) -> None:
        inside.pop()

    hooks = []
    for name, module in model.named_modules():
        slot = name.rsplit(".", 1)[-1]
        if slot in SLOTS:
            hooks.append(module.register_forward_pre_hook(lambda _m, _a, slot=slot: inside.append(slot)))
            hooks.append(module.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield totals
    finally:
        for hook in hooks:
            hook.remove()


def use_reference_fused_ops(model: torch.nn.Module, group: torch.distributed.ProcessGroup) -> None:
    """Route every Flash-Overlap linear of ``model`` through the symm_mem autograd functions, over
    torch's reference implementations of the fused ops (the fused ops need CUDA and NCCL)."""
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
    from megatron_ext.layers.symm_mem import FusedGroup, torch_reference_ops

    ops = torch_reference_ops()
    for module in model.modules():
        if isinstance(module, (FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear)):
            module.fused = FusedGroup(group.group_name, group.size(), ops, module.overlap.name)


def measure(args: argparse.Namespace, backend: str) -> dict[str, int]:
    """This rank's saved bytes by slot for one forward of the GPT with ``backend``'s linears; the
    backward that follows runs on them (and checks they are what it needs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.integration.gpt import (
        build_gpt_model,
        gpt_config,
        gpt_loss,
        local_layer_spec,
        padded_vocab_size,
    )
    from megatron_ext.layers.config import FlashOverlapConfig
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    group = ps.get_tensor_model_parallel_group()
    spec = (
        local_layer_spec()
        if backend == "megatron_core"
        else get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True, backend="p2p"))
    )
    config = gpt_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        tensor_model_parallel_size=group.size(),
        sequence_parallel=True,
    )
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt_model(config, padded_vocab_size(args.vocab, group.size()), args.seq, spec)
    if backend == "symm_mem":
        use_reference_fused_ops(model, group)
    tokens = torch.randint(
        0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(args.batch, args.seq),
        "position_ids": torch.arange(args.seq).expand(args.batch, args.seq),
    }
    with saved_bytes(model) as totals:
        loss = gpt_loss(model, batch)
    loss.backward()
    return dict(totals)


def markdown(args: dict[str, Any], per_rank: list[dict[str, dict[str, int]]]) -> str:
    """The table of rank 0's KiB by slot and backend, with each backend's ratio to megatron-core."""
    tp = len(per_rank)
    result = per_rank[0]
    lines = [
        f"Activation memory saved for backward, per rank (rank 0 of TP={tp}), KiB; GPT with "
        f"{args['layers']} layers, hidden {args['hidden']}, {args['heads']} heads, sequence {args['seq']}, "
        f"micro-batch {args['batch']}, fp32, sequence parallel. symm_mem: computed (its autograd "
        "functions over torch's reference ops, which return the same tensors as the fused ops).",
        "",
        "| backend | " + " | ".join(SLOTS) + " | other | total | total / megatron-core |",
        "|---|" + "---:|" * (len(SLOTS) + 3),
    ]
    base = sum(result["megatron_core"].values())
    for backend in BACKENDS:
        row = result[backend]
        cells = [f"{row.get(slot, 0) / 2**10:,.0f}" for slot in (*SLOTS, "other")]
        total = sum(row.values())
        lines.append(
            f"| {backend} | " + " | ".join(cells) + f" | {total / 2**10:,.0f} | {total / base:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.core_on_cpu import enable_cpu_support
    from multirank import write_result

    warnings.filterwarnings("ignore")  # gloo's tensor collectives warn on every call in torch 2.13
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    enable_cpu_support()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dist.get_world_size(), create_gloo_process_groups=False
    )
    write_result({backend: measure(args, backend) for backend in BACKENDS})
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # Defaults: scripts/presets/tiny-cpu.args, the main job's CPU demo model.
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "flash_overlap")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # set for the launched ranks
    args = parser.parse_args()
    if args.rank:
        _rank_main(args)
        return
    from multirank import launch_ranks

    per_rank = launch_ranks([*RANK_MODULE, *sys.argv[1:], "--rank"], world_size=args.tp, timeout=1800)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "rank")}
    label = f"activation_memory_tp{args.tp}_h{args.hidden}_s{args.seq}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{label}.json").write_text(json.dumps({"args": settings, "per_rank": per_rank}, indent=1))
    table = markdown(settings, per_rank)
    (args.out / f"{label}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
    exit_without_teardown()
