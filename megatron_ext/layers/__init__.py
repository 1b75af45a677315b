"""Flash-Overlap tensor/sequence-parallel linears: the P2P overlap schedules and the drop-in layers.

The GPT layer spec lives in :mod:`megatron_ext.layers.spec` (imported on its own: it builds on
:mod:`megatron_ext.gpt`, which itself imports this package's norm).
"""

from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
from megatron_ext.layers.p2p_link import OverlapGroup, PeerTimeoutError, PeerTransferError
from megatron_ext.layers.p2p_overlap import all_gather_compute, compute_reduce_scatter

__all__ = [
    "FlashOverlapColumnParallelLinear",
    "FlashOverlapRowParallelLinear",
    "OverlapGroup",
    "PeerTimeoutError",
    "PeerTransferError",
    "all_gather_compute",
    "compute_reduce_scatter",
]
