"""The Flash-Overlap spec builder changes no model silently: on megatron-core's TransformerEngine
layer spec, whose qkv and fc1 linears carry the layer's norms, it composes our linears with the norm
in its own slot, and the model equals megatron-core's local-spec model forward and backward; modules
it does not know (mixture of experts, multi-latent attention, TE's fused MLP, other linears) are
refused by name.

TE is not installed here, and megatron-core 0.16's ``get_gpt_layer_with_transformer_engine_spec``
needs it only for its spec provider's classes: the tests call megatron-core's own function with a
provider whose TE classes are stand-ins of the same module and name (never built), and megatron-core's
core attention in place of TE's, so that the model can be built on CPU.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_ext.layers.config import FlashOverlapConfig
from tests.helpers.flash_overlap import setup_tp
from tests.helpers.gpt import seeded_gpt

TE_MODULE = "megatron.core.extensions.transformer_engine"


def _stand_in(name: str, base: type = torch.nn.Module) -> type:
    def refuse(self, *args, **kwargs):
        raise ImportError(f"{name} is a stand-in: Transformer Engine is not installed")

    return type(name, (base,), {"__module__": TE_MODULE, "__qualname__": name, "__init__": refuse})


def _te_spec(**options):
    """megatron-core's ``get_gpt_layer_with_transformer_engine_spec(**options)``, with stand-ins for
    TE's classes (see the module's docstring)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.mlp import MLP

    te = {name: _stand_in(name) for name in ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear")}
    te |= {name: _stand_in(name) for name in ("TELayerNormColumnParallelLinear", "TENorm", "TEActivationOp")}

    class TESpecProvider(LocalSpecProvider):
        """TESpecProvider's choices (megatron.core.extensions.transformer_engine_spec_provider)."""

        def linear(self) -> type:
            return te["TELinear"]

        def column_parallel_linear(self) -> type:
            return te["TEColumnParallelLinear"]

        def row_parallel_linear(self) -> type:
            return te["TERowParallelLinear"]

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return te["TELayerNormColumnParallelLinear"]

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
            return te["TENorm"]

        def activation_func(self) -> type:
            return te["TEActivationOp"]

    with mock.patch.multiple(
        gpt_layer_specs, TESpecProvider=TESpecProvider, TEFusedMLP=_stand_in("TEFusedMLP", MLP), create=True
    ):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)


def test_a_te_spec_gets_its_norms_back_in_their_own_slots():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_ext.integration.gpt import local_layer_spec
    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear, FlashOverlapRowParallelLinear
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    te = _te_spec()
    assert te.submodules.input_layernorm is IdentityOp and te.submodules.pre_mlp_layernorm is IdentityOp
    spec = get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True), base=te)
    layer, local = spec.submodules, local_layer_spec().submodules
    assert layer.input_layernorm is local.input_layernorm
    assert layer.pre_mlp_layernorm is local.pre_mlp_layernorm
    # Checkpoints keep the fused layout's keys, as megatron-core's local spec maps them.
    local_keys = get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    assert layer.sharded_state_dict_keys_map == {**te.submodules.sharded_state_dict_keys_map, **local_keys}
    attention, mlp = layer.self_attention.submodules, layer.mlp.submodules
    assert issubclass(attention.linear_qkv, FlashOverlapColumnParallelLinear)
    assert issubclass(mlp.linear_fc1, FlashOverlapColumnParallelLinear)
    assert issubclass(attention.linear_proj, FlashOverlapRowParallelLinear)
    assert issubclass(mlp.linear_fc2, FlashOverlapRowParallelLinear)
    assert attention.core_attention is te.submodules.self_attention.submodules.core_attention

    # Where the fused linear stays, so does its norm: nothing is composed.
    partial = get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True, layers=["proj", "fc2"]), base=te)
    assert partial.submodules.input_layernorm is IdentityOp
    assert (
        partial.submodules.self_attention.submodules.linear_qkv.__name__ == "TELayerNormColumnParallelLinear"
    )


def _te_composed_against_megatron_core_local(tp: int) -> dict[str, float]:
    from megatron.core import parallel_state as ps

    from megatron_ext.integration.gpt import gpt_loss, local_layer_spec, padded_vocab_size
    from megatron_ext.layers.sequence_parallel import allreduce_sequence_parallel_grads
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    setup_tp(tp)
    seq, vocab = 12, padded_vocab_size(100, tp)
    tokens = torch.randint(0, 100, (2, seq + 1), generator=torch.Generator().manual_seed(3))
    batch = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(2, seq),
        "position_ids": torch.arange(seq).expand(2, seq),
    }
    specs = {
        "local": local_layer_spec(),
        "te": get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True), base=_te_spec()),
    }
    runs = {}
    for name, spec in specs.items():
        model = seeded_gpt(
            5, hidden=24, vocab=vocab, seq=seq, tp=tp, sequence_parallel=True, ffn=40, layer_spec=spec
        )
        allreduce_sequence_parallel_grads(model, ps.get_tensor_model_parallel_group())
        loss = gpt_loss(model, batch)
        loss.backward()
        runs[name] = (loss.item(), dict(model.named_parameters()))
    (loss_ref, params_ref), (loss_te, params_te) = runs["local"], runs["te"]
    assert params_ref.keys() == params_te.keys(), "the composed model has other parameters"
    errors = {"loss": abs(loss_te - loss_ref) / abs(loss_ref)}
    for key, p in params_ref.items():
        assert torch.equal(p, params_te[key]), f"{key}: weights differ for the same seed"
        q = params_te[key].grad
        errors[key] = ((q - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-12)).item()
    return errors


def test_the_composed_te_spec_model_equals_megatron_core_local_forward_and_backward(run_ranks):
    for errors in run_ranks(2, _te_composed_against_megatron_core_local, 2):
        assert any("input_layernorm" in key for key in errors), "the model has no layer norms"
        bad = {key: error for key, error in errors.items() if error > 1e-5}
        assert not bad, bad


def _refusal(base, layers=("qkv", "proj", "fc1", "fc2")) -> str:
    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    with pytest.raises(ValueError) as info:
        get_flash_overlap_layer_spec(FlashOverlapConfig(enabled=True, layers=list(layers)), base=base)
    message = str(info.value)
    assert "--flash-overlap-layers" in message and "--transformer-impl local" in message, message
    return message


def test_mixture_of_experts_is_refused_by_name_and_left_alone_when_not_asked_for():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_ext.layers.spec import get_flash_overlap_layer_spec

    moe = "megatron.core.transformer.moe.moe_layer.MoELayer"
    assert f"flash_overlap.layers has 'fc1', but the base layer spec's mlp is ModuleSpec({moe})" in _refusal(
        _te_spec(num_experts=4)
    )
    local_moe = get_gpt_layer_local_spec(num_experts=4)
    assert f"mlp is ModuleSpec({moe})" in _refusal(local_moe, layers=["fc2"])
    attention_only = get_flash_overlap_layer_spec(
        FlashOverlapConfig(enabled=True, layers=["qkv", "proj"]), base=local_moe
    )
    assert attention_only.submodules.mlp.module.__name__ == "MoELayer"


def test_multi_latent_attention_and_te_fused_mlp_are_refused_by_name():
    mla = "megatron.core.transformer.multi_latent_attention.MLASelfAttention"
    assert (
        f"self_attention is ModuleSpec({mla}), not megatron.core.transformer.attention.SelfAttention"
        in _refusal(_te_spec(multi_latent_attention=True))
    )
    assert f"mlp is ModuleSpec({TE_MODULE}.TEFusedMLP)" in _refusal(_te_spec(use_te_op_fuser=True), ["fc1"])


def test_a_linear_it_does_not_know_is_refused_by_name():
    from megatron.core.transformer.heterogeneous.linear_replacements import ColumnParallelLinearGathered

    from megatron_ext.integration.gpt import local_layer_spec

    spec = local_layer_spec()
    spec.submodules.self_attention.submodules.linear_qkv = ColumnParallelLinearGathered
    message = _refusal(spec, ["qkv"])
    assert (
        "linear_qkv is megatron.core.transformer.heterogeneous.linear_replacements.ColumnParallelLinearGathered"
        in message
    )
    assert f"{TE_MODULE}.TELayerNormColumnParallelLinear" in message  # what it does know


def test_a_fused_norm_next_to_a_norm_of_its_own_is_refused():
    te = _te_spec()
    te.submodules.input_layernorm = _stand_in("TENorm")
    message = _refusal(te, ["qkv"])
    assert (
        "applies a norm itself, and its input_layernorm is megatron.core.extensions.transformer_engine.TENorm"
        in message
    )


def test_fp8_is_refused_by_the_layers():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, fp8="hybrid", use_cpu_initialization=True
    )
    with pytest.raises(
        ValueError, match="does not support config.fp8: disable it, or use TransformerEngine's"
    ):
        FlashOverlapColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_)
