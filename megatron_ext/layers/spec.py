"""The GPT layer spec that plugs the Flash-Overlap linears into megatron-core's transformer layer."""

from __future__ import annotations

import copy

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.gpt import local_layer_spec
from megatron_ext.layers.config import FlashOverlapConfig
from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear


def _configured(cls: type, config: FlashOverlapConfig) -> type:
    """A subclass of ``cls`` with the config's P2P mode, timeout and backend as defaults. A class, not
    a partial: megatron-core's ``build_module`` instantiates only classes, functions or ModuleSpecs."""
    name = f"{cls.__name__}_{config.mode}_{config.backend}"
    defaults = {"p2p_mode": config.mode, "p2p_timeout_s": config.timeout_s, "overlap_backend": config.backend}
    return type(name, (cls,), {**defaults, "__module__": __name__, "__qualname__": name})


def get_flash_overlap_layer_spec(config: FlashOverlapConfig, base: ModuleSpec | None = None) -> ModuleSpec:
    """A copy of ``base`` (default: megatron-core's local GPT layer spec with sequence-parallel-capable
    norms, :func:`megatron_ext.gpt.local_layer_spec`) whose linear_qkv / linear_proj / linear_fc1 /
    linear_fc2 named in ``config.layers`` are the Flash-Overlap layers; ``base`` unchanged when
    ``config.enabled`` is false. The model's TransformerConfig needs sequence_parallel=True at TP > 1."""
    spec = copy.deepcopy(base) if base is not None else local_layer_spec()
    if not config.enabled:
        return spec
    column = _configured(FlashOverlapColumnParallelLinear, config)
    row = _configured(FlashOverlapRowParallelLinear, config)
    attention = getattr(spec.submodules, "self_attention", None)
    mlp = getattr(spec.submodules, "mlp", None)
    slots = {
        "qkv": (getattr(attention, "submodules", None), "linear_qkv", column),
        "proj": (getattr(attention, "submodules", None), "linear_proj", row),
        "fc1": (getattr(mlp, "submodules", None), "linear_fc1", column),
        "fc2": (getattr(mlp, "submodules", None), "linear_fc2", row),
    }
    for layer in config.layers:
        holder, field, cls = slots[layer]
        if holder is None or not hasattr(holder, field):
            raise ValueError(
                f"flash_overlap.layers has {layer!r} but the base layer spec has no {field} (a MoE or "
                "multi-latent-attention spec?): drop it from flash_overlap.layers or use a dense GPT spec"
            )
        setattr(holder, field, cls)
    return spec
