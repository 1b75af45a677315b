"""The GPT layer spec that plugs the Flash-Overlap linears into megatron-core's transformer layer.

The builder looks at what it replaces, so that the model it returns computes what the base spec's
model computes: megatron-core's and TransformerEngine's plain linears inside the dense attention and
MLP are replaced, TE's norm-fused linear is composed with the sequence-parallel norm of
:func:`local_layer_spec`, anything else is refused by name. TE classes are recognised by module and
name, so a TE spec can be checked where TE is not installed. The full table: docs/flash_overlap.md."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from mdsp_base.topology import Topology
from megatron_ext.layers.config import FlashOverlapConfig
from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
from megatron_ext.layers.norm import SequenceParallelNorm

_TE = "megatron.core.extensions.transformer_engine"
Kind = Literal["column", "row"]
OURS: dict[Kind, type] = {"column": FlashOverlapColumnParallelLinear, "row": FlashOverlapRowParallelLinear}
# The linears our layers replace without changing the computation, by qualified name.
PLAIN: dict[Kind, frozenset[str]] = {
    "column": frozenset(
        {f"{_TE}.TEColumnParallelLinear", f"{ColumnParallelLinear.__module__}.ColumnParallelLinear"}
    ),
    "row": frozenset({f"{_TE}.TERowParallelLinear", f"{RowParallelLinear.__module__}.RowParallelLinear"}),
}
# Column linears that apply the layer's norm themselves.
FUSED_NORM = frozenset({f"{_TE}.TELayerNormColumnParallelLinear"})
FIX = (
    "drop it from flash_overlap.layers (--flash-overlap-layers), or build on a dense local layer spec "
    "(megatron_ext.layers.spec.local_layer_spec; in Megatron-LM --transformer-impl local)"
)


@dataclass(frozen=True)
class Slot:
    """Where a linear named in ``flash_overlap.layers`` sits in a transformer layer's spec."""

    container: str
    """The layer's submodule holding it: self_attention or mlp."""
    container_module: type
    """megatron-core's module there whose linears we know how to replace."""
    field: str
    """The linear's field in the container's submodules."""
    kind: Kind
    """Column- or row-parallel."""
    norm: str | None = None
    """The layer's norm slot before this linear, which a fused-norm linear leaves IdentityOp."""


SLOTS = {
    "qkv": Slot("self_attention", SelfAttention, "linear_qkv", "column", "input_layernorm"),
    "proj": Slot("self_attention", SelfAttention, "linear_proj", "row"),
    "fc1": Slot("mlp", MLP, "linear_fc1", "column", "pre_mlp_layernorm"),
    "fc2": Slot("mlp", MLP, "linear_fc2", "row"),
}


def local_layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer spec with norms that also work under sequence parallelism."""
    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return spec


def _describe(obj: object) -> str:
    """The qualified name of a class (or of a ModuleSpec's module), for matching and for messages."""
    if isinstance(obj, ModuleSpec):
        return f"ModuleSpec({_describe(obj.module)})"
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


def _configured(cls: type, config: FlashOverlapConfig, topology: Topology | None) -> type:
    """A subclass of ``cls`` with the config's P2P mode, timeout and backend, and ``topology``, as
    defaults. A class, not ``ModuleSpec(params=...)``: megatron-core's SelfAttention calls
    ``submodules.linear_qkv(...)`` itself, not through ``build_module``, so a ModuleSpec in that slot
    is not callable; and not a partial, which ``build_module`` cannot instantiate."""
    name = f"{cls.__name__}_{config.mode}_{config.backend}"
    defaults = {
        "p2p_mode": config.mode,
        "p2p_timeout_s": config.timeout_s,
        "p2p_compute_slices": config.compute_slices,
        "overlap_backend": config.backend,
        "overlap_topology": topology,
    }
    return type(name, (cls,), {**defaults, "__module__": __name__, "__qualname__": name})


def _container_submodules(spec: ModuleSpec, layer: str, slot: Slot) -> object:
    """The submodules holding ``slot``'s linear; refused unless the container is the dense module."""
    container = getattr(spec.submodules, slot.container, None)
    if not isinstance(container, ModuleSpec) or container.module is not slot.container_module:
        raise ValueError(
            f"flash_overlap.layers has '{layer}', but the base layer spec's {slot.container} is "
            f"{_describe(container)}, not {_describe(slot.container_module)}, whose "
            f"{slot.field} the Flash-Overlap layers replace: {FIX}"
        )
    return container.submodules


def _unfuse_norm(spec: ModuleSpec, layer: str, slot: Slot, fused: object) -> None:
    """Put the norm that ``fused`` applies into the layer's norm slot, as megatron-core's local spec
    has it (the norm and the key map that keeps checkpoints in the fused layer's layout)."""
    assert slot.norm is not None  # called for slots with a norm only
    present = getattr(spec.submodules, slot.norm)
    if present is not IdentityOp:
        raise ValueError(
            f"flash_overlap.layers has '{layer}': the base layer spec's {slot.field} is {_describe(fused)}, "
            f"which applies a norm itself, and its {slot.norm} is {_describe(present)}, a second norm "
            f"before it: one norm slot cannot hold both; {FIX}"
        )
    local = local_layer_spec().submodules
    setattr(spec.submodules, slot.norm, getattr(local, slot.norm))
    key = f"{slot.norm}."
    spec.submodules.sharded_state_dict_keys_map = {
        **(spec.submodules.sharded_state_dict_keys_map or {}),
        key: local.sharded_state_dict_keys_map[key],
    }


def get_flash_overlap_layer_spec(
    config: FlashOverlapConfig, base: ModuleSpec | None = None, topology: Topology | None = None
) -> ModuleSpec:
    """A GPT layer spec whose linears named in ``config.layers`` are the Flash-Overlap layers. The
    model's TransformerConfig needs sequence_parallel=True at TP > 1.

    Args:
        config (FlashOverlapConfig): the plugin's section: layers, P2P mode, timeout, backend.
        base (ModuleSpec, optional): the spec to start from (copied, never changed); None:
            :func:`local_layer_spec`.
        topology (Topology, optional): where the ranks sit, for ``backend: auto`` to check that the
            TP group is in one node.

    Returns:
        ModuleSpec: the copy, with linear_qkv / linear_proj / linear_fc1 / linear_fc2 replaced as
        ``config.layers`` says and a fused norm composed; the unchanged copy when ``config.enabled``
        is false.

    Raises:
        ValueError: a named slot holds something the builder does not know, named in the message.
    """
    spec = copy.deepcopy(base) if base is not None else local_layer_spec()
    if not config.enabled:
        return spec
    replacements = {kind: _configured(cls, config, topology) for kind, cls in OURS.items()}
    for layer in config.layers:
        slot = SLOTS[layer]
        holder = _container_submodules(spec, layer, slot)
        current = getattr(holder, slot.field, None)
        name = _describe(current)
        if slot.norm is not None and name in FUSED_NORM:
            _unfuse_norm(spec, layer, slot, current)
        elif name not in PLAIN[slot.kind] and not (
            isinstance(current, type) and issubclass(current, OURS[slot.kind])
        ):
            known = PLAIN[slot.kind] | (FUSED_NORM if slot.norm else frozenset())
            raise ValueError(
                f"flash_overlap.layers has '{layer}', but the base layer spec's {slot.field} is {name}, "
                f"not one the Flash-Overlap layers replace without changing the model "
                f"({', '.join(sorted(known))}): {FIX}"
            )
        setattr(holder, slot.field, replacements[slot.kind])
    return spec
