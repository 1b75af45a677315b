"""What the A/B command runs: stock ZeRO-3, DeepSpeed's hpZ and ZeRO++ where they can run (its kernels
build, or a quantizer module stands in for them), ours."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from mdsp_base.topology import Topology


@dataclass
class Variant:
    """One engine of an A/B run: the command's, or a ZeRO benchmark's."""

    name: str
    """Display name."""
    ours: bool
    """Built by the hierarchical variant's initialize, else by deepspeed.initialize."""
    zero: dict[str, Any] = field(default_factory=dict)
    """zero_optimization keys on top of the user's."""
    hierarchical: dict[str, Any] = field(default_factory=dict)
    """hierarchical_zero keys on top of the user's (ours only)."""
    skipped: str | None = None
    """Why it is not run here (None: it runs)."""
    role: str | None = None
    """What it stands for in a benchmark's targets (flat, hpz, zero++, serial, pipelined)."""


def _loaded_quantizer() -> Any:
    """The quantizer op module DeepSpeed's ZeRO++ has loaded, or was given, in this process.

    Returns:
        The module in both of ZeRO++'s slots (qwZ's and qgZ's), or None while either is empty.
    """
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    weights, gradients = CUDAQuantizer.quantizer_cuda_module, coalesced_collectives.quantizer_module
    return weights if weights is not None and gradients is not None else None


def quantizer_unavailable(device: torch.device, ranks_per_node: int) -> str | None:
    """Whether DeepSpeed's qwZ / qgZ run here as ZeRO++ does on a cluster: a quantizer module is in
    place or its CUDA kernels build, and qgZ's node is the topology's.

    Args:
        device: this rank's device.
        ranks_per_node: the topology's ranks per node.

    Returns:
        Why they cannot run, or None when they can.
    """
    if _loaded_quantizer() is None:
        if device.type != "cuda":
            return (
                f"DeepSpeed's qwZ/qgZ are CUDA kernels (QuantizerBuilder); this run's device is {device.type} "
                "and no quantizer module stands in for them in this process"
            )
        try:
            from deepspeed.ops.op_builder import QuantizerBuilder

            builder = QuantizerBuilder()
            if not builder.is_compatible():
                return "DeepSpeed's QuantizerBuilder is not compatible with this system"
            builder.load()
        except Exception as exc:  # a failed JIT build names its own cause
            return f"DeepSpeed's QuantizerBuilder did not build: {type(exc).__name__}: {str(exc)[:200]}"
    from deepspeed.accelerator import get_accelerator

    # qgZ's intra-node all-to-all groups are runs of device_count() ranks (deepspeed.utils.groups)
    count = get_accelerator().device_count()
    if count != ranks_per_node:
        return (
            f"DeepSpeed's qgZ takes a node to be the accelerator's device count, {count} here, where the "
            f"topology has {ranks_per_node} ranks per node"
        )
    return None


QUANTIZED_HOPS = {"quantized_weights": True, "quantized_gradients": "int4"}
"""Ours with ZeRO++'s quantization across nodes: int8 weight gathers (qwZ's), int4 gradients (qgZ's)."""


def variants(topology: Topology, device: torch.device, quantized_hops: bool = False) -> list[Variant]:
    """The A/B command's variants.

    Args:
        topology: the job's ranks.
        device: this rank's device (ZeRO++'s kernels are CUDA's).
        quantized_hops: also ours with :data:`QUANTIZED_HOPS`.

    Returns:
        Stock ZeRO-3, hpZ at each valid secondary size, ZeRO++ (or why not), ours (and ours with
        quantized hops).
    """
    world = topology.world_size
    sizes = sorted({s for s in (topology.ranks_per_package, topology.ranks_per_node) if 1 < s < world})
    out = [Variant("zero3", ours=False)]
    out += [Variant(f"hpZ({s})", ours=False, zero={"zero_hpz_partition_size": s}) for s in sizes]
    if not sizes:
        out.append(
            Variant("hpZ", ours=False, skipped=f"no secondary size between 1 and the world ({world}) here")
        )
    node = topology.ranks_per_node if 1 < topology.ranks_per_node < world else None
    zeropp: dict[str, Any] = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    if node is None:
        reason: str | None = "ZeRO++'s hpZ needs more than one node"
    else:
        reason = quantizer_unavailable(device, node)
        zeropp["zero_hpz_partition_size"] = node
    out.append(Variant("zero++ (hpZ + qwZ + qgZ)", ours=False, zero=zeropp, skipped=reason))
    out.append(Variant("ours", ours=True))
    if quantized_hops:
        out.append(Variant("ours, quantized hops", ours=True, hierarchical=dict(QUANTIZED_HOPS)))
    return out


def ds_config(user: dict, variant: Variant, profile: str | None) -> dict:
    """The user's DeepSpeed JSON as this variant runs it.

    Args:
        user: the user's DeepSpeed JSON (not changed).
        variant: the variant.
        profile: the probe profile ours reads (hierarchical_zero.profile); None: the JSON's.

    Returns:
        ZeRO stage 3 with the variant's keys, the batch given by micro batch and accumulation, and
        hierarchical_zero (with the variant's keys) enabled for ours only.
    """
    cfg = copy.deepcopy(user)
    cfg.pop("train_batch_size", None)
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("optimizer", {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}})
    cfg.setdefault("steps_per_print", 10**9)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": 3, **variant.zero}
    section = {**(cfg.get("hierarchical_zero") or {}), **variant.hierarchical}
    section["enabled"] = variant.ours
    if variant.ours and profile is not None:
        section["profile"] = profile
    cfg["hierarchical_zero"] = section
    return cfg
