"""Megatron-DeepSpeed's two sequence parallelisms under DeepSpeed, as the patch runs them: Megatron's
``--sequence-parallel`` (over the TP group) made to train as without it, and what Ulysses
(``--ds-sequence-parallel-size``) with gradient clipping should tell its user.
"""

from __future__ import annotations

import logging

import torch

from mdsp_base.section import ConfigError
from megatron_ext.integration.upstream.hooks import megatron_args

logger = logging.getLogger(__name__)


def sequence_parallel_under_deepspeed(model: torch.nn.Module) -> None:
    """Megatron's ``--sequence-parallel`` under DeepSpeed, as the patch mends it: the transformer
    layers see a slice of the sequence, so the gradients of their TP-replicated parameters (norms,
    row-parallel biases) are partial sums, which Megatron's optimizer sums over TP and DeepSpeed's
    does not: summed here when autograd makes them. Learned absolute positions are refused (the tree
    keeps a slice of them per TP rank, initialised alike on every rank: not the model without SP)."""
    from megatron.core import parallel_state

    from megatron_ext.layers.sequence_parallel import allreduce_sequence_parallel_grads

    args = megatron_args()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not getattr(args, "sequence_parallel", False) or tp == 1:
        return
    language_model = getattr(model, "language_model", None)
    if language_model is None or getattr(language_model, "encoder", None) is None:
        raise ConfigError(
            f"--sequence-parallel under DeepSpeed is wired for the GPT model ({type(model).__name__} has no "
            "language_model.encoder): pass --no-pipeline-parallel, or drop --sequence-parallel"
        )
    if getattr(args, "add_position_embedding", False):
        raise ConfigError(
            f"--sequence-parallel at TP={tp} with learned absolute position embeddings: the tree gives each TP "
            "rank its own slice of them, initialised alike (another model than without SP); pass "
            "--use-rotary-position-embeddings (or --no-position-embedding), or drop --sequence-parallel"
        )
    for param in language_model.encoder.parameters():
        if not getattr(param, "tensor_model_parallel", False):
            param.sequence_parallel = True
    count = allreduce_sequence_parallel_grads(model, parallel_state.get_tensor_model_parallel_group())
    logger.info("sequence parallelism: %d TP-replicated parameters' gradients summed over TP", count)


def ulysses_clipping_notice(sp: int, clipping: float, zero_stage: int, mean: bool = False) -> str | None:
    """What a Ulysses job with gradient clipping should know about DeepSpeed's ZeRO-3, or None;
    ``mean``: hierarchical ZeRO's ``sequence_parallel_gradients: mean`` is on."""
    if sp <= 1 or zero_stage != 3:
        return None
    if mean:
        return (
            f"hierarchical_zero.sequence_parallel_gradients=mean: the optimizer gets SP=1's gradient "
            f"(DeepSpeed's ZeRO-3 gradient times SP={sp}), so gradient clipping acts as at SP=1"
        )
    if clipping <= 0:
        return None
    return (
        f"Ulysses SP={sp} under ZeRO-3: DeepSpeed hands the optimizer 1/{sp} of the gradient an SP=1 run "
        f"gets (stock DistributedAttention and Flash-Overlap alike), so gradient_clipping={clipping:g} clips "
        f"where SP=1 would clip at {clipping * sp:g}: with clipping active the run trains apart from SP=1 "
        "(Adam's steps are otherwise scale-free). Set gradient_clipping to clipping/SP to match SP=1, or "
        "with --hierarchical-zero set hierarchical_zero.sequence_parallel_gradients to mean."
    )
