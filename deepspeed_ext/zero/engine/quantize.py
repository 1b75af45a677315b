"""Blockwise int8 / int4 quantized collectives in plain torch (no kernels: ROCm, CUDA and CPU alike).

Used for the hops that cross nodes only. A buffer is cut into blocks of ``block`` elements; each
block is sent as integers ``round(x / s)`` with one fp32 scale ``s = absmax / qmax`` (int8: 127,
int4: 7, two values per byte). The weight all-gather dequantizes every member's block, its own
included, so every rank computes with the same weights (ZeRO++'s qwZ does the same). The gradient
reduce-scatter is an all-to-all of quantized pieces summed in fp32 by their owner, with error
feedback: what quantization dropped from this rank's pieces is added to the next call's input
(ZeRO++'s qgZ reduces in fp16 after a quantized all-to-all; error feedback is ours).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mdsp_base import comm

QMAX = {8: 127, 4: 7}


def _check(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization to {bits} bits is not supported: use 8 or 4")
    if block < 2 or block % 2:
        raise ValueError(f"quantization block of {block} elements: use an even size >= 2")


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ([rows, n]) -> (uint8 payload [rows, ceil(n / block) * block * bits / 8],
    fp32 scales [rows, ceil(n / block)]); each row quantized on its own. Works in place on one fp32
    copy of ``x`` (transient: 4 bytes per element, then the 1-byte integers)."""
    _check(bits, block)
    rows, n = x.shape
    padded = -(-n // block) * block
    work = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
    work[:, :n] = x
    blocks = work.view(rows, -1, block)
    scales = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=2, keepdim=True).div_(QMAX[bits])
    scales.masked_fill_(scales == 0, 1.0)
    blocks.div_(scales).round_().clamp_(-QMAX[bits], QMAX[bits]).add_(QMAX[bits] + 1)
    q = work.to(torch.uint8)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return q, scales.view(rows, -1)


def dequantize(payload: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: fp32 [rows, n] (one fp32 buffer, the padding sliced off)."""
    rows = payload.shape[0]
    if bits == 4:
        payload = torch.stack((payload & 0xF, payload >> 4), dim=2).view(rows, -1)
    values = payload.to(torch.float32).sub_(QMAX[bits] + 1)
    blocks = scales.shape[1]
    return values.view(rows, blocks, -1).mul_(scales.view(rows, blocks, 1)).view(rows, -1)[:, :n]


def all_gather_int8(out: torch.Tensor, held: torch.Tensor, group: dist.ProcessGroup, block: int) -> None:
    """``out`` ([size * n]) = every member's ``held`` ([n]) in group order, sent as blockwise int8."""
    size = out.numel() // held.numel()
    payload, scales = quantize(held.reshape(1, -1), 8, block)
    payloads = torch.empty(size, payload.shape[1], dtype=payload.dtype, device=payload.device)
    all_scales = torch.empty(size, scales.shape[1], dtype=scales.dtype, device=scales.device)
    comm.all_gather_into_tensor(payloads, payload, group=group)
    comm.all_gather_into_tensor(all_scales, scales, group=group)
    out.view(size, -1).copy_(dequantize(payloads, all_scales, 8, held.numel()))


def reduce_scatter_quantized(
    held: torch.Tensor, group: dist.ProcessGroup, bits: int, block: int, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over the group of ``held`` ([size * n]), this member's ``n`` (like reduce_scatter_tensor),
    pieces sent quantized. ``residual`` (fp32, like ``held``, or None) is added before quantizing;
    returns (this member's sum in ``held``'s dtype, the new fp32 residual)."""
    size = dist.get_world_size(group)
    x = held.view(size, -1).to(torch.float32, copy=True)  # this call's own copy: it becomes the residual
    if residual is not None:
        x.add_(residual.view(size, -1))
    payload, scales = quantize(x, bits, block)
    n = x.shape[1]
    got_payload, got_scales = torch.empty_like(payload), torch.empty_like(scales)
    comm.all_to_all_single(got_payload, payload, group=group)
    comm.all_to_all_single(got_scales, scales, group=group)
    total = dequantize(got_payload, got_scales, bits, n).sum(dim=0)
    del got_payload, got_scales
    x.sub_(dequantize(payload, scales, bits, n))
    return total.to(held.dtype), x.view(-1)
