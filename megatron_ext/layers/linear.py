"""Drop-in replacements for megatron-core's ColumnParallelLinear / RowParallelLinear whose
sequence-parallel all-gather and reduce-scatter run as overlapped P2P schedules (Flash-Overlap).

They subclass megatron-core's layers and call their constructors, so arguments, weight
initialisation, parameter attributes, checkpoint sharding and extra state are megatron-core's; only
``forward`` differs, and the options it cannot honour are refused at construction. The autograd
functions behind ``forward`` are the backends' (:mod:`megatron_ext.layers.p2p.linear`, the default,
and :mod:`megatron_ext.layers.symm_mem`). Forward and backward of each layer, and why the wgrad GEMM
is not sliced: docs/flash_overlap.md."""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from mdsp_base.topology import Topology
from megatron_ext.layers import backend as backends
from megatron_ext.layers import symm_mem
from megatron_ext.layers.backend import Requested
from megatron_ext.layers.p2p.linear import P2PAllGatherLinear, P2PLinearReduceScatter
from megatron_ext.layers.p2p.link import DEFAULT_TIMEOUT_S, Mode, OverlapGroup, check_nccl_waits, run_device
from megatron_ext.layers.symm_mem import FusedGroup, SymmMemAllGatherLinear, SymmMemLinearReduceScatter
from megatron_ext.layers.wgrad import require_main_grad


class _GroupContext(Protocol):
    group: dist.ProcessGroup


class _GatherLastDim(torch.autograd.Function):
    """Fwd: all-gather of the TP-split last dimension (gather_output, megatron-core's, not overlapped); bwd: keep own part."""

    @staticmethod
    def forward(ctx: _GroupContext, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group = group
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: _GroupContext, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]  # torch declares backward(ctx, *grad_outputs)
        return grad.chunk(ctx.group.size(), dim=-1)[ctx.group.rank()].contiguous(), None


class _FlashOverlapMixin:
    """Option checks, the P2P settings and the backend choice shared by both layers."""

    p2p_mode: ClassVar[Mode] = Mode.DIRECT
    """P2P pattern used when the constructor gets none (the spec sets it per config)."""
    p2p_timeout_s: ClassVar[float] = DEFAULT_TIMEOUT_S
    """Wait bound used when the constructor gets none."""
    p2p_compute_slices: ClassVar[int] = 0
    """GEMMs per fused collective (0: one per rank's slice; the spec sets it per config)."""
    overlap_backend: ClassVar[Requested] = Requested.P2P
    """Backend requested when the constructor gets none: p2p, auto or symm_mem."""
    overlap_topology: ClassVar[Topology | None] = None
    """Where the ranks sit, used when the constructor gets none (auto checks the TP group's node)."""
    fusion_off_while_built: ClassVar[bool] = False
    """Build megatron-core's layer with ``gradient_accumulation_fusion`` off (its constructor insists
    on Apex's fused wgrad kernel for it; these layers accumulate into main_grad with torch ops), and
    honour the option after."""
    # Set by the megatron-core layer this mixes into.
    config: ModelParallelConfig
    tp_group: dist.ProcessGroup | None
    is_expert: bool
    sequence_parallel: bool

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        p2p_mode: Mode | None = None,
        timeout_s: float | None = None,
        backend: Requested | None = None,
        topology: Topology | None = None,
        **megatron_kwargs: Any,
    ) -> None:
        """Build megatron-core's layer, then the overlap's group and backend.

        Args:
            input_size (int): first dimension of the weight matrix, as megatron-core's.
            output_size (int): second dimension of the weight matrix, as megatron-core's.
            p2p_mode (Mode, optional): P2P pattern, ``direct`` or ``ring``; None: the class default.
            timeout_s (float, optional): bound of every gloo wait; None: the class default.
            backend (Requested, optional): ``p2p``, ``auto`` or ``symm_mem``; None: the class default.
            topology (Topology, optional): where the ranks sit, for ``auto``; None: the class default.
            **megatron_kwargs: megatron-core's constructor arguments (``config``, ``init_method``,
                ``tp_comm_buffer_name``, which names the layer in errors, ...).

        Raises:
            ValueError: an option the overlapped forward cannot honour, or no sequence parallelism
                at TP > 1.
            BackendUnavailableError: ``symm_mem`` forced where it cannot run.
        """
        config = megatron_kwargs["config"]
        if self.fusion_off_while_built and config.gradient_accumulation_fusion:
            without = copy.copy(config)
            without.gradient_accumulation_fusion = False
            megatron_kwargs = {**megatron_kwargs, "config": without}
        super().__init__(input_size, output_size, **megatron_kwargs)  # type: ignore[call-arg]  # megatron-core's layer
        if self.fusion_off_while_built:
            self.config, self.gradient_accumulation_fusion = config, config.gradient_accumulation_fusion
        self._setup_overlap(
            p2p_mode,
            timeout_s,
            backend,
            topology,
            megatron_kwargs.get("tp_comm_buffer_name"),
            self.sequence_parallel,
        )

    def _setup_overlap(
        self,
        mode: Mode | None,
        timeout_s: float | None,
        backend: Requested | None,
        topology: Topology | None,
        name: str | None,
        sequence_parallel: bool,
    ) -> None:
        kind = type(self).__name__
        cfg = self.config
        tp = 1 if self.tp_group is None else self.tp_group.size()
        megatron_core = f"megatron-core's {kind.removeprefix('FlashOverlap')}"
        unsupported = {  # option: (set?, the layers that honour it)
            "is_expert=True": (self.is_expert, megatron_core),
            "config.defer_embedding_wgrad_compute": (cfg.defer_embedding_wgrad_compute, megatron_core),
            "config.cpu_offloading": (cfg.cpu_offloading, megatron_core),
            # TransformerConfig only: FP8 GEMMs are TransformerEngine's, whose linears these would replace.
            "config.fp8": (getattr(cfg, "fp8", None), "TransformerEngine's linears (drop flash_overlap)"),
        }
        for option, (present, alternative) in unsupported.items():
            if present:
                raise ValueError(f"{kind} does not support {option}: disable it, or use {alternative}")
        if tp > 1 and not sequence_parallel:
            raise ValueError(
                f"{kind} overlaps the sequence-parallel all-gather/reduce-scatter and needs "
                f"config.sequence_parallel=True at tensor-parallel size {tp}: pass --sequence-parallel, "
                "or disable flash_overlap"
            )
        self.overlap = OverlapGroup(
            group=self.tp_group if tp > 1 else None,
            mode=mode or self.p2p_mode,
            timeout_s=timeout_s if timeout_s is not None else self.p2p_timeout_s,
            name=name or kind,
            compute_slices=self.p2p_compute_slices,
        )
        device = run_device(getattr(self, "weight", None))
        check_nccl_waits(self.overlap, device)
        # All ranks of the TP group construct their layers together, so the backend is agreed here.
        chosen = backends.resolve_backend(
            backend or self.overlap_backend, self.overlap.group, device, topology or self.overlap_topology
        )
        self.fused = None
        if chosen == "symm_mem":
            assert self.tp_group is not None  # chosen only with TP peers
            self.fused = FusedGroup(
                self.tp_group.group_name, tp, symm_mem.torch_fused_ops(), self.overlap.name
            )

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor, features: int) -> None:
        name = self.overlap.name
        if x.dim() < 2 or x.shape[-1] != features:
            raise ValueError(
                f"layer {name!r}: input of shape {tuple(x.shape)} must be [s, b, {features}] (sequence first)"
            )
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"layer {name!r}: input dtype {x.dtype} differs from the weight dtype {weight.dtype}: cast the "
                "input, run under torch.autocast, or build the model with config.params_dtype matching the activations"
            )
        if x.device != weight.device:
            raise ValueError(
                f"layer {name!r}: input is on {x.device} but the weight on {weight.device}: move one of them"
            )
        if self.config.gradient_accumulation_fusion and weight.requires_grad and torch.is_grad_enabled():
            require_main_grad(weight, name)


class FlashOverlapColumnParallelLinear(_FlashOverlapMixin, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear (same arguments, same ``(output, bias)`` return) whose
    sequence all-gather is fused with the GEMM. Extra keyword arguments: ``p2p_mode`` ("direct" or
    "ring"), ``timeout_s`` (gloo waits), ``backend`` ("p2p", "auto" or "symm_mem") and ``topology``
    (where the ranks sit, for auto); ``tp_comm_buffer_name`` names the layer in error messages."""

    fusion_off_while_built = True

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All-gather of the sequence fused with the GEMM.

        Args:
            input_ (torch.Tensor): [s/tp, b, h], this rank's part of the sequence.
            weight (torch.Tensor, optional): the weight to use, compulsory when the layer was built
                with ``skip_weight_param_allocation``.
            runtime_gather_output (bool, optional): gather the output's last dimension over TP;
                None: the layer's ``gather_output``.

        Returns:
            - output: [s, b, o/tp] (or [s, b, o] when gathered)
            - bias: the bias where ``skip_bias_add``, else None
        """
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    f"layer {self.overlap.name!r} was built with skip_weight_param_allocation=True: pass weight= to forward"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"layer {self.overlap.name!r}: supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        self._check_input(input_, weight, self.input_size)
        fuse = self.config.gradient_accumulation_fusion
        if self.fused is not None:
            output = SymmMemAllGatherLinear.apply(input_, weight, self.fused, fuse)
        else:
            output = P2PAllGatherLinear.apply(input_, weight, self.overlap, fuse)
        if self.bias is not None and not self.skip_bias_add:
            output = output + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.overlap.group is not None:
            output = _GatherLastDim.apply(output, self.overlap.group)
        return output, self.bias if self.skip_bias_add else None


class FlashOverlapRowParallelLinear(_FlashOverlapMixin, RowParallelLinear):
    """megatron-core's RowParallelLinear (same arguments, same ``(output, bias)`` return) whose
    sequence reduce-scatter is fused with the GEMM. Extra keyword arguments as for the column layer."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The GEMM fused with the reduce-scatter of the sequence.

        Args:
            input_ (torch.Tensor): [s, b, i/tp], the whole sequence, TP-split features.

        Returns:
            - output: [s/tp, b, o], this rank's part of the sequence
            - bias: the bias where ``skip_bias_add``, else None
        """
        self._check_input(input_, self.weight, self.input_size_per_partition)
        n = self.overlap.size
        if input_.shape[0] % n:
            raise ValueError(
                f"layer {self.overlap.name!r}: sequence length {input_.shape[0]} is not divisible by the "
                f"tensor-parallel size {n}: pad the sequence to a multiple of {n}"
            )
        fuse = self.config.gradient_accumulation_fusion
        if self.fused is not None:
            output = SymmMemLinearReduceScatter.apply(input_, self.weight, self.fused, fuse)
        else:
            output = P2PLinearReduceScatter.apply(input_, self.weight, self.overlap, fuse)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
