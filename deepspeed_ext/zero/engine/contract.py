"""What the hierarchical variant requires of DeepSpeed, its config and the model, checked before
any collective; and what it reads from them (this rank's parameters, the largest collectives)."""

from __future__ import annotations

import deepspeed
import torch

from deepspeed_ext.zero.config import HierarchicalZeroConfig, check_zero_stage
from deepspeed_ext.zero.cost.volume import ShardSpec
from mdsp_base.section import ConfigError

SUPPORTED_DEEPSPEED = ("0.19.",)
_CONFLICTS = {
    "zero_quantized_weights": "qwZ",
    "zero_quantized_nontrainable_weights": "qwZ for frozen weights",
    "zero_quantized_gradients": "qgZ",
}


def check_deepspeed_version(version: str | None = None) -> None:
    """DeepSpeed 0.19.x, whose internals the variant enters.

    Args:
        version: the version to check; None: the one installed.

    Raises:
        ConfigError: another version.
    """
    version = version or deepspeed.__version__
    if not version.startswith(SUPPORTED_DEEPSPEED):
        raise ConfigError(
            f"hierarchical_zero supports DeepSpeed {', '.join(v + 'x' for v in SUPPORTED_DEEPSPEED)}, found {version}: "
            "install deepspeed>=0.19,<0.20 or disable hierarchical_zero"
        )


def validate_deepspeed_config(ds: dict) -> None:
    """Reject DeepSpeed settings that cannot work with the variant (no collective runs here).

    Args:
        ds: the DeepSpeed config.

    Raises:
        ConfigError: the first setting refused, with what to set instead.
    """
    zero = ds.get("zero_optimization") or {}
    check_zero_stage(zero.get("stage", 0))
    if (zero.get("zero_hpz_partition_size") or 1) > 1:
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size={zero['zero_hpz_partition_size']} conflicts with hierarchical_zero, "
            "which places the secondary weight copy itself (hierarchical_zero.secondary_level): remove zero_hpz_partition_size"
        )
    for key, name in _CONFLICTS.items():
        if zero.get(key):
            raise ConfigError(
                f"zero_optimization.{key}=true ({name}) cannot be combined with hierarchical_zero: "
                f"set it to false or disable hierarchical_zero"
            )
    if zero.get("reduce_scatter") is False:
        raise ConfigError(
            "zero_optimization.reduce_scatter=false makes ZeRO-3 all-reduce gradients, which bypasses "
            "the hierarchical reduce-scatter: remove it or disable hierarchical_zero"
        )
    if zero.get("stage3_use_all_reduce_for_fetch_params") or zero.get("use_all_reduce_for_fetch_params"):
        raise ConfigError(
            "zero_optimization.stage3_use_all_reduce_for_fetch_params=true replaces the parameter "
            "all-gather that hierarchical_zero splits into hops: remove it or disable hierarchical_zero"
        )
    offload = zero.get("offload_param") or {}
    if zero.get("cpu_offload_param") or offload.get("device", "none") != "none":
        raise ConfigError(
            "zero_optimization.offload_param is not supported with hierarchical_zero "
            "(the secondary copy would be offloaded too): remove it or disable hierarchical_zero"
        )


def shard_spec(model: torch.nn.Module, ds: dict) -> ShardSpec:
    """This rank's parameters (a TP shard under TP) and the element sizes ZeRO-3 sends them in.

    Args:
        model: the model (whole, or partitioned by ZeRO-3).
        ds: the DeepSpeed config (its precision).

    Returns:
        The parameters as the cost model sees them.
    """
    params = list(model.parameters())
    if not params:
        raise ConfigError("the model has no parameters: nothing for ZeRO-3 to partition")
    numels = tuple(int(getattr(p, "ds_numel", p.numel())) for p in params)
    half = (ds.get("bf16") or {}).get("enabled") or (ds.get("fp16") or {}).get("enabled")
    weight = 2 if half else params[0].element_size()
    grad = {"fp32": 4, "fp16": 2, "bf16": 2}.get(ds.get("communication_data_type") or "", weight)
    owners = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    return ShardSpec(param_numels=numels, weight_bytes=weight, grad_bytes=grad, gathers_per_pass=owners)


def largest_collectives(ds: dict, model: ShardSpec) -> tuple[int, int]:
    """Elements of the largest parameter all-gather and gradient reduce-scatter ZeRO-3 issues: a
    prefetch (reduce) bucket, which DeepSpeed closes after the parameter that fills it, so up to one
    parameter more; never more than the model. DeepSpeed's defaults where the config is silent."""
    zero = ds.get("zero_optimization") or {}
    prefetch_key = (
        "stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"
    )
    prefetch = _bucket_elems(zero, prefetch_key, 5e7)
    bucket = _bucket_elems(zero, "reduce_bucket_size", 5e8)
    total, largest = sum(model.param_numels), max(model.param_numels)
    return min(total, prefetch + largest), min(total, bucket + largest)


def _bucket_elems(zero: dict, key: str, default: float) -> int:
    """A bucket size in elements; a whole non-negative number, as DeepSpeed requires ("auto" is
    for the Hugging Face trainer to fill in before DeepSpeed sees the config)."""
    value = zero.get(key, default)
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 0:
        raise ConfigError(
            f"zero_optimization.{key}={value!r} is not a bucket size: give a whole number of elements "
            f"such as {int(default)}, or remove the key for DeepSpeed's default"
        )
    return int(value)


def check_before_collectives(ds: dict, hz: HierarchicalZeroConfig) -> None:
    """What :func:`~.api.prepare` checks before its first collective (also when a plan is reused).

    Args:
        ds: the DeepSpeed config.
        hz: the ``hierarchical_zero`` section.

    Raises:
        ConfigError: a configuration the variant cannot run.
    """
    if not hz.enabled:
        raise ConfigError("hierarchical_zero.enabled is false: call deepspeed.initialize directly")
    check_deepspeed_version()
    validate_deepspeed_config(ds)
    if hz.grad_sync == "accumulation_boundary" and ds.get("managed_gradient_accumulation") is False:
        raise ConfigError(
            "hierarchical_zero.grad_sync=accumulation_boundary needs DeepSpeed to know the boundary during "
            "backward, which managed_gradient_accumulation=false hides: remove that key or set grad_sync "
            "to every_micro_batch"
        )
