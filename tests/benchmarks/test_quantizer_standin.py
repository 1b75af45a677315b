"""The quantizer stand-ins against references written from DeepSpeed's kernels (csrc/quantization,
quantization_utils.h), element by element: a group's scale absmax / 2^(bits-1) in fp32 (1 for an
all-zero group), codes round-half-even(x * 2^(bits-1) / absmax) clamped to [-2^(bits-1),
2^(bits-1) - 1], int4 pairs packed first-in-the-high-nibble, fp16 in and out; the swizzled order
of the kernel's comment; the round trip within the bound its arithmetic gives; and their
installation, recorded and undone."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from benchmarks.zero import quantizer_standin as q
from deepspeed_ext.zero.tools.ab.variants import quantizer_unavailable, variants
from mdsp_base.installer import Installer
from mdsp_base.topology import Topology
from tests.megatron_ext.integration.test_process_changes import documented_rows

CPU = torch.device("cpu")


def ref_group(values: list[float], bits: int) -> tuple[list[int], np.float32]:
    """One group as the kernel quantizes it: fp32 scale 2^bits / (2 absmax), stored as its inverse."""
    absmax = max(abs(np.float32(np.float16(v))) for v in values)
    scale = np.float32(1.0) if absmax == 0 else np.float32(2**bits) / (np.float32(2) * absmax)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes = [int(min(max(np.rint(np.float32(np.float16(v)) * scale), low), high)) for v in values]
    return codes, np.float32(1) / scale


def ref_pack(codes: list[int], bits: int) -> list[int]:
    """Bytes as int8: int8 codes as they are; int4 pairs in PackedInt4 {high : 4; low : 4}, whose
    first field takes the byte's low bits, the quantizer writing {second, first}."""
    if bits == 8:
        return codes
    out = []
    for first, second in zip(codes[::2], codes[1::2], strict=True):
        byte = ((first & 0xF) << 4) | (second & 0xF)
        out.append(byte - 256 if byte >= 128 else byte)
    return out


def ref_quantize(x: torch.Tensor, groups: int, bits: int) -> tuple[list[int], list[np.float32]]:
    flat = x.reshape(-1).tolist()
    size = len(flat) // groups
    codes, scales = [], []
    for g in range(groups):
        c, s = ref_group(flat[g * size : (g + 1) * size], bits)
        codes += c
        scales.append(s)
    return ref_pack(codes, bits), scales


def ref_dequantize(codes: list[int], scales: list[np.float32], groups: int) -> list[np.float16]:
    size = len(codes) // groups
    return [np.float16(np.float32(c) * scales[i // size]) for i, c in enumerate(codes)]


def signed_codes(packed: list[int], bits: int) -> list[int]:
    """Packed int8 bytes back to codes, by the bit-field's reading: high nibble first."""
    if bits == 8:
        return packed
    out = []
    for byte in packed:
        u = byte & 0xFF
        out += [(u >> 4) - 16 if u >> 4 >= 8 else u >> 4, (u & 0xF) - 16 if u & 0xF >= 8 else u & 0xF]
    return out


def sample(groups: int, size: int, seed: int) -> torch.Tensor:
    """Groups of very different magnitudes: the first's absmax positive, the second all zero, the
    last's absmax negative."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, size, generator=g) * torch.logspace(-3, 2, groups)[:, None]
    x[0, 5] = 2 * x[0].abs().max()
    x[1] = 0.0
    x[-1, 3] = -2 * x[-1].abs().max()
    return x


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("groups", [3, 8])  # an odd group count too: the kernel takes any
def test_quantize_and_dequantize_match_the_kernels_arithmetic(bits, groups):
    x = sample(groups, 16, bits + groups)
    codes, scales = q.quantize(x.reshape(2, -1), groups, bits, q.Symmetric)
    assert codes.dtype == torch.int8 and codes.shape == (2, x.numel() // 2 // (8 // bits))
    assert scales.dtype == torch.float32 and scales.shape == (groups, 1)
    want_codes, want_scales = ref_quantize(x, groups, bits)
    assert codes.reshape(-1).tolist() == want_codes
    assert scales.reshape(-1).tolist() == [float(s) for s in want_scales]
    assert want_scales[1] == 1.0 and not any(
        want_codes[len(want_codes) // groups : 2 * len(want_codes) // groups]
    )
    back = q.dequantize(codes, scales, groups, bits, q.Symmetric)
    assert back.dtype == torch.float16 and back.shape == (2, x.numel() // 2)
    want = ref_dequantize(signed_codes(want_codes, bits), want_scales, groups)
    assert back.reshape(-1).tolist() == [float(v) for v in want]


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_within_half_a_step_and_a_whole_step_where_clamped(bits):
    # step = absmax / 2^(bits-1). Rounding moves a value at most half a step; only positive values
    # past (2^(bits-1) - 1/2) steps are clamped (the codes stop at 2^(bits-1) - 1, -2^(bits-1) on
    # the negative side), a positive absmax (2^(bits-1) steps) by a whole step.
    # The fp16 read is exact for these values (cast first); the fp16 write adds half an fp16 ulp.
    x = sample(6, 64, bits).to(torch.float16).to(torch.float32)
    codes, scales = q.quantize(x, 6, bits, q.Symmetric)
    back = q.dequantize(codes, scales, 6, bits, q.Symmetric).to(torch.float32)
    step = x.abs().amax(dim=1, keepdim=True) / 2 ** (bits - 1)
    clamped = x > (2 ** (bits - 1) - 0.5) * step
    bound = torch.where(clamped, step, step / 2) + back.abs() * 2**-11
    assert bool(((back - x).abs() <= bound).all())
    assert bool((back[clamped] < x[clamped]).all()) and bool(clamped[0, 5])
    assert torch.equal(back[1], torch.zeros(64))


def ref_swizzle_order(partitions: list[list[int]], nodes: int, devices: int, slices: int) -> list[int]:
    """The kernel's comment: of 2 nodes x 4 devices, partitions 0..7 become 0 4 1 5 2 6 3 7 (each
    device's partitions for every node together); with slicing, the first slices of all
    partitions in that order, then the second slices."""
    out = []
    for s in range(slices):
        for device in range(devices):
            for node in range(nodes):
                part = partitions[node * devices + device]
                size = len(part) // slices
                out += part[s * size : (s + 1) * size]
    return out


@pytest.mark.parametrize(("bits", "slices"), [(4, 1), (8, 1), (4, 2)])
def test_swizzle_quant_lays_each_devices_partitions_together(bits, slices):
    nodes, devices, per_partition = 2, 4, 2 * slices
    groups = nodes * devices * per_partition
    x = sample(groups, 8, groups + bits)
    codes, scales = q.swizzle_quant(x, groups, bits, q.Symmetric, slices, nodes, devices)
    assert codes.shape == (x.numel() * bits // 8,) and scales.shape == (groups, 1)
    want_codes, want_scales = ref_quantize(x, groups, bits)
    bytes_per_group = x.shape[1] * bits // 8
    by_group = [want_codes[g * bytes_per_group : (g + 1) * bytes_per_group] for g in range(groups)]
    order = ref_swizzle_order(
        [list(range(p * per_partition, (p + 1) * per_partition)) for p in range(nodes * devices)],
        nodes, devices, slices,
    )  # fmt: skip
    assert codes.tolist() == [b for g in order for b in by_group[g]]
    assert scales.reshape(-1).tolist() == [float(want_scales[g]) for g in order]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_reduction_sums_the_devices_in_fp16_and_requantizes(bits):
    devices, in_per_device, out_groups, size = 3, 4, 2, 16
    parts = [sample(in_per_device, size, 10 * bits + d) for d in range(devices)]
    packed, scales = [], []
    for part in parts:
        c, s = ref_quantize(part, in_per_device, bits)
        packed += c
        scales += s
    got, got_scales = q.quantized_reduction(
        torch.tensor(packed, dtype=torch.int8)[None],
        torch.tensor([float(s) for s in scales])[:, None],
        devices * in_per_device, out_groups, bits, q.Symmetric, devices,
    )  # fmt: skip
    n = in_per_device * size
    values = [ref_dequantize(signed_codes(packed[d * len(packed) // devices : (d + 1) * len(packed) // devices], bits),
                             scales[d * in_per_device : (d + 1) * in_per_device], in_per_device)
              for d in range(devices)]  # fmt: skip
    total = []
    for i in range(n):
        acc = np.float16(0)
        for d in range(devices):
            acc = np.float16(acc + values[d][i])
        total.append(float(acc))
    want_codes, want_scales = ref_quantize(torch.tensor(total), out_groups, bits)
    assert got.shape == (1, len(packed) // devices) and got_scales.shape == (out_groups, 1)
    assert got.reshape(-1).tolist() == want_codes
    assert got_scales.reshape(-1).tolist() == [float(s) for s in want_scales]


def test_what_the_kernels_cannot_take_is_refused_by_name():
    with pytest.raises(ValueError, match="Symmetric only"):
        q.quantize(torch.ones(16), 2, 8, q.Asymmetric)
    with pytest.raises(ValueError, match="8 or 4 bits"):
        q.quantize(torch.ones(16), 2, 2, q.Symmetric)
    with pytest.raises(ValueError, match="multiple of 8"):
        q.quantize(torch.ones(24), 2, 8, q.Symmetric)
    with pytest.raises(ValueError, match="odd"):
        q.quantize(torch.ones(16, 1), 2, 4, q.Symmetric)
    with pytest.raises(ValueError, match="past the scales"):
        q.dequantize(torch.ones(20, dtype=torch.int8), torch.ones(3), 3, 8, q.Symmetric)
    with pytest.raises(ValueError, match="split over 3 tensors"):
        q.quantized_reduction(torch.ones(64, dtype=torch.int8), torch.ones(4, 1), 4, 2, 8, q.Symmetric, 3)
    with pytest.raises(ValueError, match="partitions"):
        q.swizzle_quant(torch.ones(48), 6, 4, q.Symmetric, 1, 2, 2)


def test_installed_for_zeropp_recorded_as_documented_and_undone():
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    before = os.environ.get("LOCAL_SIZE")
    assert "no quantizer module stands in" in quantizer_unavailable(CPU, 2)
    with Installer() as installer:
        q.install(installer, 2)
        assert (
            CUDAQuantizer.quantizer_cuda_module is q.GlooWeights
            and coalesced_collectives.quantizer_module is q
        )
        x = sample(2, 8, 0)
        codes, flat = q.GlooWeights.quantize(x, 2, 8, q.Symmetric)
        assert flat.shape == (2,) and torch.equal(flat, q.quantize(x, 2, 8, q.Symmetric)[1].view(-1))
        assert quantizer_unavailable(CPU, 2) is None
        zeropp = variants(Topology(world_size=8, ranks_per_node=2, ranks_per_package=2), CPU)[2]
        assert zeropp.name == "zero++ (hpZ + qwZ + qgZ)" and zeropp.skipped is None
        assert "device count, 2 here" in quantizer_unavailable(CPU, 4)
        recorded = {(c.owner, c.what) for c in installer.changes}
        assert recorded <= documented_rows() and len(recorded) == 2
    assert CUDAQuantizer.quantizer_cuda_module is None and coalesced_collectives.quantizer_module is None
    assert os.environ.get("LOCAL_SIZE") == before
