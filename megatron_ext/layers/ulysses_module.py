"""``UlyssesSelfAttention``: the Ulysses block of ``ulysses.py`` as a module that owns its QKV and
output projections, with the QKV weight held group-major (one GEMM per destination head group) and
checkpoints read and written in Megatron-DeepSpeed's [q | k | v] layout."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_ext.layers.p2p.link import DEFAULT_TIMEOUT_S, Mode, OverlapGroup, check_nccl_waits, run_device
from megatron_ext.layers.ulysses import HeadSplit, LocalAttention, ulysses_attention


class UlyssesSelfAttention(torch.nn.Module):
    """Self-attention for Ulysses sequence parallelism that owns its QKV and output projections
    (``query_key_value`` and ``dense``, named as Megatron-DeepSpeed's), with both all-to-alls
    overlapped with them. The QKV weight and bias are held group-major (one GEMM per destination)
    and its state dict holds them in Megatron-DeepSpeed's [q | k | v] layout, so checkpoints move
    between this module and upstream's both ways. ``forward(hidden [s/n, b, h], *args)`` returns
    ``(output [s/n, b, h], dense bias or None)``: the bias is left to the caller, as Megatron's
    ``skip_bias_add``."""

    _qkv_order: torch.Tensor  # a buffer (register_buffer in __init__)

    def __init__(
        self,
        hidden_size: int,
        split: HeadSplit,
        local_attention: LocalAttention,
        sequence_group: dist.ProcessGroup | None,
        *,
        bias: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """
        Args:
            hidden_size (int): the model's hidden size.
            split (HeadSplit): the heads and their split over ``sequence_group`` (held group-major
                whatever its ``group_major`` says).
            local_attention (LocalAttention): attention over the whole sequence for this rank's heads.
            sequence_group (dist.ProcessGroup, optional): the sequence-parallel group; None: one rank.
            bias (bool): both projections have a bias.
            timeout_s (float): bound of every gloo wait.
            device (torch.device | str, optional): where the parameters are made.
            dtype (torch.dtype, optional): the parameters' dtype.

        Raises:
            ValueError: ``split`` is for another number of ranks than the group's.
        """
        super().__init__()
        size = 1 if sequence_group is None else sequence_group.size()
        if split.ranks != size:
            raise ValueError(f"the head split is for {split.ranks} ranks but the sequence group has {size}")
        self.split = dataclasses.replace(split, group_major=True)
        self.local_attention = local_attention
        self.og = OverlapGroup(sequence_group, Mode.DIRECT, timeout_s, "ulysses_attention")
        width = (split.heads + 2 * split.kv_heads) * split.head_dim
        kw = {"device": device, "dtype": dtype}
        self.query_key_value = torch.nn.Linear(hidden_size, width, bias=bias, **kw)
        self.dense = torch.nn.Linear(split.heads * split.head_dim, hidden_size, bias=bias, **kw)
        check_nccl_waits(self.og, run_device(self.dense.weight))
        self.register_buffer("_qkv_order", self.split.group_major_order(), persistent=False)
        with torch.no_grad():  # initialised in the [q | k | v] layout, as upstream's, then regrouped
            self._regroup(dict(self.query_key_value.named_parameters()), self._qkv_order)
        self.register_state_dict_post_hook(_save_standard_layout)
        self.register_load_state_dict_pre_hook(_load_standard_layout)

    @staticmethod
    def _regroup(tensors: dict[str, torch.Tensor], order: torch.Tensor) -> None:
        """Permute the QKV weight's and bias's rows in place: ``t[:] = t[order]``."""
        for t in tensors.values():
            t.copy_(t.index_select(0, order.to(t.device)))

    def forward(self, hidden: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden (torch.Tensor): [s/n, b, h], this rank's tokens.
            *args: passed on to the local attention (e.g. the attention mask).

        Returns:
            - output: [s/n, b, h], without the output projection's bias
            - bias: the output projection's bias, or None
        """
        out = ulysses_attention(
            hidden,
            self.query_key_value.weight,
            self.query_key_value.bias,
            self.dense.weight,
            self.local_attention,
            self.split,
            self.og,
            *args,
        )
        return out, self.dense.bias


def _qkv_entries(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    names = (f"{prefix}query_key_value.weight", f"{prefix}query_key_value.bias")
    return {k: state[k] for k in names if k in state}


def _save_standard_layout(
    module: UlyssesSelfAttention, state: dict[str, torch.Tensor], prefix: str, *_: object
) -> None:
    """State-dict hook: the QKV rows written in Megatron-DeepSpeed's [q | k | v] layout."""
    inverse = module._qkv_order.argsort()
    for key, t in _qkv_entries(state, prefix).items():
        state[key] = t.index_select(0, inverse.to(t.device))


def _load_standard_layout(
    module: UlyssesSelfAttention, state: dict[str, torch.Tensor], prefix: str, *_: object
) -> None:
    """Load hook: [q | k | v] QKV rows regrouped by destination before they are copied in."""
    for key, t in _qkv_entries(state, prefix).items():
        state[key] = t.index_select(0, module._qkv_order.to(t.device))
