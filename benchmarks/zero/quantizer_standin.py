"""Pure-torch stand-ins for DeepSpeed's quantizer op module (``QuantizerBuilder().load()``), so that
full ZeRO++ (hpZ + qwZ + qgZ) runs on the CPU as the ZeRO benchmarks' baseline.

ZeRO++ calls four of the module's functions, each with ``Symmetric``: ``quantize`` and
``dequantize`` (qwZ's int8 weight all-gather, ``CUDAQuantizer``), ``swizzle_quant``,
``quantized_reduction`` and ``dequantize`` (qgZ's int4 gradient all-to-all,
``all_to_all_quant_reduce``). Each here returns what the CUDA kernel returns (csrc/quantization,
quantization_utils.h), in its layout:

- a group is a contiguous run of ``numel / groups`` values; its scale is absmax / 2^(bits-1) (1 for
  an all-zero group), stored as one fp32 per group, shape (groups, 1);
- a value is quantized as round-half-even(x * 2^(bits-1) / absmax), clamped to
  [-2^(bits-1), 2^(bits-1) - 1]: the group's absmax itself lands on 2^(bits-1) and is clamped;
- int4 values are packed two per byte, the first of a pair in the high nibble (the kernels'
  ``PackedInt4 {high : 4; low : 4}`` bit-field, its first field in the low bits);
- the kernels read fp16: a value enters as its fp16 rounding, and dequantized values are fp16.
  (DeepSpeed hands qgZ's kernel the gradients in the communication dtype: an fp32 or bf16 gradient
  would be reinterpreted bit for bit by the CUDA kernel; here it is read by value.)

Only ``Symmetric`` is implemented: ZeRO++ passes nothing else. Shapes the kernels would read or
write out of their groups for (a group not a multiple of 8 values, the kernels' 16-byte loads;
groups that do not divide the input) are refused, where the kernels would return garbage.
"""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import torch

from mdsp_base.installer import Installer


class QuantizationType(enum.IntEnum):
    """The op module's ``QuantizationType`` (its pybind11 enum)."""

    Symmetric = 0
    Asymmetric = 1


OWNER = "benchmarks.zero.quantizer_standin"
MODULE_CHANGE = "DeepSpeed's quantizer op module (qwZ, qgZ): these pure-torch stand-ins"
NODE_CHANGE = "LOCAL_SIZE: the ranks per node, DeepSpeed's CPU device count, which qgZ takes for a node"
Symmetric = QuantizationType.Symmetric
Asymmetric = QuantizationType.Asymmetric
CHUNK = 8
"""Values per 16-byte fp16 load: a group's size must be a multiple of it."""


def _check(num_bits: int, quant_type: int) -> None:
    if quant_type != Symmetric:
        raise ValueError("the quantizer stand-in implements Symmetric only, the one ZeRO++ uses")
    if num_bits not in (4, 8):
        raise ValueError(f"the quantizer kernels take 8 or 4 bits, got {num_bits}")


def _group_size(numel: int, groups: int) -> int:
    if groups <= 0 or numel % groups or (numel // groups) % CHUNK:
        raise ValueError(
            f"{numel} values in {groups} groups: the kernels need groups of a multiple of {CHUNK} values"
        )
    return numel // groups


def _symmetric(values: torch.Tensor, num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of fp32 values (one group per row) as int8 codes and each row's stored fp32 scale."""
    absmax = values.abs().amax(dim=1)
    top = float(1 << (num_bits - 1))
    # the kernel's fp32 arithmetic: scale = 2^bits / (2 absmax), the stored parameter 1 / scale
    scale = torch.where(absmax == 0, torch.ones_like(absmax), (2 * top) / (2 * absmax))
    codes = torch.round(values * scale[:, None]).clamp_(-top, top - 1).to(torch.int8)
    return codes, (1 / scale)[:, None]


def _pack(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Codes in memory order as the kernels store them: int8, or int4 pairs per byte."""
    flat = codes.reshape(-1)
    if num_bits == 8:
        return flat
    pairs = flat.to(torch.int16).view(-1, 2) & 0xF
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8).view(torch.int8)


def _unpack(data: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Stored bytes back to signed codes in memory order (int16)."""
    flat = data.reshape(-1).view(torch.int8).to(torch.int16)
    if num_bits == 8:
        return flat
    first = flat >> 4  # arithmetic shift: the high nibble, sign-extended
    second = ((flat & 0xF) ^ 8) - 8  # the low nibble, sign-extended
    return torch.stack((first, second), dim=1).reshape(-1)


def _half_values(input_vals: torch.Tensor) -> torch.Tensor:
    """What the kernels read: the input's fp16 values, as fp32."""
    return input_vals.detach().to(torch.float16).to(torch.float32).reshape(-1)


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int) -> list[torch.Tensor]:
    """``quantize``: contiguous groups to int8 / packed int4 codes and their scales.

    Args:
        input_vals: the values (read as fp16).
        groups: the number of groups.
        num_bits: 8 or 4.
        quant_type: ``Symmetric``.

    Returns:
        The codes (the input's shape, last dimension halved for int4) and the scales (groups, 1).
    """
    _check(num_bits, quant_type)
    size = _group_size(input_vals.numel(), groups)
    codes, scales = _symmetric(_half_values(input_vals).view(groups, size), num_bits)
    shape = list(input_vals.shape)
    if num_bits == 4 and shape[-1] % 2:
        raise ValueError(f"int4 packs pairs along the last dimension, {shape[-1]} is odd")
    shape[-1] //= 8 // num_bits
    return [_pack(codes, num_bits).view(shape), scales]


def dequantize(
    quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: int
) -> torch.Tensor:
    """``dequantize``: codes times their group's scale, as fp16.

    Args:
        quantized_data: int8 codes or packed int4 pairs.
        params: the scales, one per group in order.
        groups: the number of groups, each ``values / groups`` values.
        num_bits: 8 or 4.
        quant_type: ``Symmetric``.

    Returns:
        fp16 values, the input's shape with the last dimension doubled for int4.
    """
    _check(num_bits, quant_type)
    codes = _unpack(quantized_data, num_bits)
    scales = params.reshape(-1).to(torch.float32)
    if groups <= 0 or codes.numel() % groups or scales.numel() < groups:
        raise ValueError(
            f"{codes.numel()} values in {groups} groups with {scales.numel()} scales: the kernel's last "
            "group would read past the scales"
        )
    shape = list(quantized_data.shape)
    shape[-1] *= 8 // num_bits
    values = codes.view(groups, -1).to(torch.float32) * scales[:groups, None]
    return values.to(torch.float16).view(shape)


def swizzle_permutation(groups: int, pipeline_size: int, nodes: int, devices_per_node: int) -> torch.Tensor:
    """Where each input group goes in ``swizzle_quant``'s output.

    The input is ``nodes * devices_per_node`` partitions (partition p holds what rank p gets), each
    cut into ``pipeline_size`` slices. Partition p = node n, device d (p = n * devices_per_node + d)
    moves to place d * nodes + n, so that each device's partitions for every node are contiguous;
    with slicing, the first slices of all partitions come first (the kernel's comment).
    """
    partitions = nodes * devices_per_node
    if groups % partitions or (groups // partitions) % pipeline_size:
        raise ValueError(
            f"{groups} groups do not split into {partitions} partitions of {pipeline_size} slices"
        )
    contiguous = groups // partitions // pipeline_size
    block = torch.arange(groups)
    x, y, z = block % contiguous, block // contiguous % pipeline_size, block // (contiguous * pipeline_size)
    place = y * partitions + (z % devices_per_node) * nodes + z // devices_per_node
    return place * contiguous + x


def swizzle_quant(
    input_vals: torch.Tensor,
    groups: int,
    num_bits: int,
    quant_type: int,
    pipeline_size: int,
    nodes: int,
    devices_per_node: int,
) -> list[torch.Tensor]:
    """``swizzle_quant``: ``quantize`` of contiguous groups, the groups then laid out for the
    two all-to-alls of qgZ (:func:`swizzle_permutation`).

    Returns:
        Flat codes (int8, or int4 pairs) and the scales (groups, 1), both in the swizzled order.
    """
    _check(num_bits, quant_type)
    size = _group_size(input_vals.numel(), groups)
    codes, scales = _symmetric(_half_values(input_vals).view(groups, size), num_bits)
    order = torch.empty(groups, dtype=torch.long)
    order[swizzle_permutation(groups, pipeline_size, nodes, devices_per_node)] = torch.arange(groups)
    return [_pack(codes[order], num_bits), scales[order]]


def quantized_reduction(
    input_vals: torch.Tensor,
    input_scales: torch.Tensor,
    in_groups: int,
    out_groups: int,
    num_bits: int,
    quant_type: int,
    devices_per_node: int,
) -> list[torch.Tensor]:
    """``quantized_reduction``: ``devices_per_node`` quantized tensors back to back, dequantized to
    fp16, summed in fp16 in their order, and quantized again in ``out_groups`` groups.

    Args:
        input_vals: the tensors' codes, one after another (each with ``in_groups / devices_per_node``
            groups).
        input_scales: their scales, in the same order.
        in_groups: groups over all the tensors.
        out_groups: groups of the sum.
        num_bits: 8 or 4 (in and out).
        quant_type: ``Symmetric``.
        devices_per_node: how many tensors.

    Returns:
        The sum's codes (the input's shape, last dimension divided by ``devices_per_node``) and its
        scales (out_groups, 1).
    """
    _check(num_bits, quant_type)
    codes = _unpack(input_vals, num_bits)
    per_tensor = codes.numel() // devices_per_node
    _group_size(codes.numel(), in_groups)
    if in_groups % devices_per_node:
        raise ValueError(f"{in_groups} groups do not split over {devices_per_node} tensors")
    scales = input_scales.reshape(in_groups, 1).to(torch.float32)
    values = (codes.view(in_groups, -1).to(torch.float32) * scales).to(torch.float16)
    values = values.view(devices_per_node, per_tensor)
    total = torch.zeros(per_tensor, dtype=torch.float16)
    for j in range(devices_per_node):  # the kernel's fp16 adds, in the tensors' order
        total = total + values[j]
    out_size = _group_size(per_tensor, out_groups)
    out, out_scales = _symmetric(total.to(torch.float32).view(out_groups, out_size), num_bits)
    shape = list(input_vals.shape)
    shape[-1] //= devices_per_node
    return [_pack(out, num_bits).view(shape), out_scales]


class GlooWeights:
    """What qwZ's slot holds: this module's ops, ``quantize``'s scales flat, (groups,) for
    (groups, 1), the same fp32 values in the same memory. DeepSpeed all-gathers them into a flat
    buffer, which NCCL takes by size alone but gloo only from an input shaped as each slice of it."""

    Symmetric = Symmetric
    dequantize = staticmethod(dequantize)

    @staticmethod
    def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int) -> list[torch.Tensor]:
        """:func:`quantize`, its scales flat."""
        codes, scales = quantize(input_vals, groups, num_bits, quant_type)
        return [codes, scales.view(-1)]


def _as_kernels() -> tuple[Any, Any]:
    """qwZ's and qgZ's modules with each function charged as the one kernel it stands for on a
    rank's device stand-in (:func:`benchmarks.device.standin.as_one_kernel`), where its several
    pure-torch passes would be charged one by one."""
    from benchmarks.device.standin import as_one_kernel

    weights = types.SimpleNamespace(
        Symmetric=Symmetric,
        quantize=as_one_kernel(GlooWeights.quantize),
        dequantize=as_one_kernel(dequantize),
    )
    gradients = types.SimpleNamespace(
        Symmetric=Symmetric,
        dequantize=as_one_kernel(dequantize),
        swizzle_quant=as_one_kernel(swizzle_quant),
        quantized_reduction=as_one_kernel(quantized_reduction),
    )
    return weights, gradients


def install(installer: Installer, ranks_per_node: int, on_device_standin: bool = False) -> None:
    """Put this module where DeepSpeed's ZeRO++ looks for its loaded quantizer module, until the
    installer closes; ``on_device_standin``: each function charged as one kernel (:func:`_as_kernels`).

    DeepSpeed loads the module once into two slots, qwZ's (``CUDAQuantizer.quantizer_cuda_module``)
    and qgZ's (``coalesced_collectives.quantizer_module``), each loaded only while empty: filling
    them leaves ``QuantizerBuilder`` alone. qwZ's gets :class:`GlooWeights`. qgZ takes a node to be the accelerator's device count,
    which DeepSpeed's CPU accelerator reads from LOCAL_SIZE (else its NUMA nodes), so LOCAL_SIZE
    is set to the ranks per node. DeepSpeed's other device calls on this path go to
    ``get_accelerator()``, the CPU here: nothing else to map.

    Args:
        installer: the owner of the changes.
        ranks_per_node: ranks per node (qgZ's intra-node all-to-all group).

    Raises:
        ValueError: DeepSpeed's accelerator is not the CPU (where the CUDA kernels may run).
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    if get_accelerator().device_name() != "cpu":
        raise ValueError(
            f"the quantizer stand-ins replace the CUDA kernels on the CPU only; DeepSpeed's accelerator "
            f"is {get_accelerator().device_name()}"
        )
    weights, gradients = _as_kernels() if on_device_standin else (GlooWeights, sys.modules[__name__])
    installer.setattr(OWNER, MODULE_CHANGE, CUDAQuantizer, "quantizer_cuda_module", weights)
    installer.setattr(OWNER, MODULE_CHANGE, coalesced_collectives, "quantizer_module", gradients)
    installer.setenv(OWNER, NODE_CHANGE, "LOCAL_SIZE", str(ranks_per_node))
