"""pytest plugin that runs DeepSpeed's own unit tests against the hierarchical ZeRO-3 variant.

Loaded by ``scripts/deepspeed_zero3_tests.sh`` into a pytest run inside a DeepSpeed checkout (never
by this repository's suite: nothing here is named ``test_*``). Wherever a test builds a ZeRO-3
engine, ``deepspeed.initialize`` builds the variant instead: the config gets a ``hierarchical_zero``
section (enabled) and goes to ``deepspeed_ext.zero.initialize`` with a topology of two nodes
(emulated: DeepSpeed's tests run every rank on one host).
``deepspeed.zero.Init`` becomes the variant's ``Init`` on a plan of its own, which that
``initialize`` then reuses (``HZ_CONTRACT_INIT=stock`` keeps DeepSpeed's, which the variant refuses
to continue). A config's ``zero_hpz_partition_size`` (stock hpZ's secondary group size) becomes the
variant's ``secondary_level`` of that size (package members or node ranks). With
``HZ_CONTRACT_VARIANT=off``, ``HZ_CONTRACT_STOCK_HPZ=<size>`` turns the tests' ZeRO-3 configs into
stock hpZ of that size instead (the baseline for a difference the variant shares with hpZ).
``HZ_CONTRACT_CPU_FP16=1`` lets fp16 configs run on a CPU whose oneDNN lacks fp16 (DeepSpeed's CPU
accelerator then refuses them; torch's own CPU kernels run them, slowly). DeepSpeed's tests run their ranks in processes forked from a forkserver, so this
module is also preloaded there, and it patches DeepSpeed when imported.

Each rank appends what the wrapper did (an engine built, a refusal) to ``HZ_CONTRACT_LOG``; the
pytest process reads what a test added and writes one JSON line per test to
``HZ_CONTRACT_RESULTS``: its outcome, the variant engines it built, the refusals, the error.
"""

from __future__ import annotations

import copy
import inspect
import json
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import deepspeed
import pytest
import torch.distributed as dist

from deepspeed_ext import zero
from deepspeed_ext.zero.cost.volume import ShardSpec
from deepspeed_ext.zero.engine import construction
from mdsp_base.section import ConfigError, read_ds_config
from mdsp_base.topology import Topology

LOG_ENV = "HZ_CONTRACT_LOG"
RESULTS_ENV = "HZ_CONTRACT_RESULTS"
LEVEL_ENV = "HZ_CONTRACT_SECONDARY_LEVEL"
INIT_ENV = "HZ_CONTRACT_INIT"
VARIANT_ENV = "HZ_CONTRACT_VARIANT"
STOCK_HPZ_ENV = "HZ_CONTRACT_STOCK_HPZ"
CPU_FP16_ENV = "HZ_CONTRACT_CPU_FP16"

_original_initialize = deepspeed.initialize
_signature = inspect.signature(_original_initialize)


def topology_for(world_size: int) -> dict[str, int]:
    """Two nodes whenever there are two ranks, so that the cross-node hop runs; two packages per
    node from four ranks on."""
    per_node = max(1, world_size // 2)
    return {"ranks_per_node": per_node, "ranks_per_package": max(1, per_node // 2)}


def hierarchical_config(config: dict, world_size: int) -> dict | None:
    """``config`` with the variant switched on, or None where stock DeepSpeed should run: not ZeRO
    stage 3, or a test that configures the variant itself."""
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") != 3 or "hierarchical_zero" in config:
        return None
    section = {"enabled": True, "secondary_level": os.environ.get(LEVEL_ENV, "auto")}
    level = hpz_level(int(zero.get("zero_hpz_partition_size") or 1), world_size)
    if level is not None:  # the test asks for hpZ: the variant's level of that size replaces it
        section["secondary_level"] = level
        zero = {key: value for key, value in zero.items() if key != "zero_hpz_partition_size"}
        config = {**config, "zero_optimization": zero}
    return {**config, "hierarchical_zero": section}


def hpz_level(hpz_size: int, world_size: int) -> str | None:
    """The variant's secondary level whose group has ``hpz_size`` ranks in :func:`topology_for`
    (package first where both have that size), or None: no hpZ asked for (size 1), or no level of
    that size (the variant then refuses ``zero_hpz_partition_size``, naming it)."""
    if hpz_size <= 1:
        return None
    layout = topology_for(world_size)
    sizes = {"package": layout["ranks_per_package"], "node": layout["ranks_per_node"]}
    if sizes["node"] == world_size:  # one node: its level would be the whole data-parallel group
        del sizes["node"]
    return next((level for level, size in sizes.items() if size == hpz_size), None)


def stock_hpz_config(config: dict, hpz_size: int) -> dict | None:
    """``config`` as stock hpZ with a secondary group of ``hpz_size`` ranks, or None where it is not
    a ZeRO stage-3 config or sets ``zero_hpz_partition_size`` itself."""
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") != 3 or "zero_hpz_partition_size" in zero:
        return None
    return {**config, "zero_optimization": {**zero, "zero_hpz_partition_size": hpz_size}}


def _log(event: str, detail: str = "") -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"event": event, "detail": detail}) + "\n")


def _bound(args: tuple, kwargs: dict) -> tuple[dict, Any, Any]:
    """``deepspeed.initialize``'s arguments by name, its ``args``, and the config wherever it was
    given (``config``, ``config_params`` or ``args.deepspeed_config``)."""
    given = dict(_signature.bind(*args, **kwargs).arguments)
    ds_args = given.get("args")
    source = given.get("config")
    source = source if source is not None else given.get("config_params")
    source = source if source is not None else getattr(ds_args, "deepspeed_config", None)
    return given, ds_args, source


def initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize``; a ZeRO-3 config builds the hierarchical variant."""
    given, ds_args, source = _bound(args, kwargs)
    world = dist.get_world_size() if dist.is_initialized() else 1
    config = hierarchical_config(read_ds_config(source), world) if source is not None else None
    if config is None or given.get("model") is None:
        return _original_initialize(*args, **kwargs)
    given.pop("config", None)
    given.pop("config_params", None)
    if getattr(ds_args, "deepspeed_config", None) is not None:
        # deepspeed.initialize refuses a config in both places; ours is the dict
        given["args"] = copy.copy(ds_args)
        given["args"].deepspeed_config = None
    try:
        topology = Topology(world_size=world, **topology_for(world))
        result = zero.initialize(config=config, topology=topology, **given)
    except ConfigError as exc:
        _log("refused", str(exc))
        raise
    except Exception as exc:  # some tests skip themselves when initialize raises: keep why
        _log("error", f"{type(exc).__name__}: {exc}")
        raise
    _log("engine", result[0].hierarchical_zero.levels.secondary_level.value)
    return result


def stock_hpz_initialize(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.initialize`` with ``zero_hpz_partition_size`` = ``HZ_CONTRACT_STOCK_HPZ`` added to
    a ZeRO-3 config (stock DeepSpeed, no variant)."""
    given, ds_args, source = _bound(args, kwargs)
    config = None
    if source is not None:
        config = stock_hpz_config(read_ds_config(source), int(os.environ[STOCK_HPZ_ENV]))
    if config is None:
        return _original_initialize(*args, **kwargs)
    given.pop("config_params", None)
    given["config"] = config
    if getattr(ds_args, "deepspeed_config", None) is not None:
        given["args"] = copy.copy(ds_args)
        given["args"].deepspeed_config = None
    _log("stock_hpz", os.environ[STOCK_HPZ_ENV])
    return _original_initialize(**given)


# construction.Init subclasses deepspeed.zero.Init: imported above, before install() replaces it
_original_init = deepspeed.zero.Init
# Arguments that choose the groups themselves: the variant's Init sets them from its plan
_OWN_GROUPS = ("data_parallel_group", "zero_param_parallel_group", "sequence_data_parallel_group", "mpu")


def init(*args: Any, **kwargs: Any) -> Any:
    """``deepspeed.zero.Init`` as the variant's :class:`~deepspeed_ext.zero.engine.construction.Init`, on a plan
    made for it; ``deepspeed.initialize`` then finds that plan from the parameters and reuses it.
    Stock where the test picks the groups itself, disables it, or configures a stage other than 3.
    The plan is made from a one-element model: its secondary level is what ``auto`` picks there."""
    if os.environ.get(INIT_ENV, "hierarchical") != "hierarchical" or args or kwargs.get("enabled") is False:
        return _original_init(*args, **kwargs)
    if any(kwargs.get(key) is not None for key in _OWN_GROUPS):
        return _original_init(*args, **kwargs)
    source = kwargs.get("config_dict_or_path", kwargs.get("config"))
    ds = dict(read_ds_config(source)) if source is not None else {}
    ds.setdefault("zero_optimization", {"stage": 3})
    world = dist.get_world_size()
    config = hierarchical_config(ds, world)
    if config is None:
        return _original_init(*args, **kwargs)
    topology = Topology(world_size=world, **topology_for(world))
    try:
        plan = zero.prepare(
            ShardSpec(param_numels=(1,), weight_bytes=4, grad_bytes=4), config, topology=topology
        )
    except ConfigError as exc:
        _log("refused", str(exc))
        raise
    _log("init", plan.levels.secondary_level.value)
    return construction.Init(plan.levels, **kwargs)


def install() -> None:
    """Route ``deepspeed.initialize`` and ``deepspeed.zero.Init`` through :func:`initialize` and
    :func:`init` (idempotent); ``HZ_CONTRACT_VARIANT=off`` leaves DeepSpeed alone, for the same
    tests on stock ZeRO-3 (which failures are DeepSpeed's or the test's own), or, with
    ``HZ_CONTRACT_STOCK_HPZ``, routes ``deepspeed.initialize`` through :func:`stock_hpz_initialize`."""
    if os.environ.get(CPU_FP16_ENV) == "1":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda self: True
    if os.environ.get(VARIANT_ENV, "on") == "off":
        if os.environ.get(STOCK_HPZ_ENV):
            deepspeed.initialize = stock_hpz_initialize
        return
    deepspeed.initialize = initialize
    deepspeed.zero.Init = init


install()


def pytest_configure(config: pytest.Config) -> None:
    # The ranks of DeepSpeed's DistributedTest are forked from a forkserver: preload this module
    # there, so that they run the wrapper too.
    multiprocessing.set_forkserver_preload(["hz_contract"])


def _events(path: str | None, start: int) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(start)
        return [json.loads(line) for line in f if line.strip()]


_outcomes: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    log = os.environ.get(LOG_ENV)
    start = os.path.getsize(log) if log and os.path.exists(log) else 0
    _outcomes[item.nodeid] = {"test": item.nodeid, "outcome": "passed", "error": ""}
    yield
    events = _events(log, start)
    record = _outcomes.pop(item.nodeid)
    # summed over ranks
    record["variant_engines"] = sum(1 for e in events if e["event"] == "engine")
    record["variant_inits"] = sum(1 for e in events if e["event"] == "init")
    record["secondary_levels"] = sorted({e["detail"] for e in events if e["event"] == "engine"})
    record["refusals"] = sorted({e["detail"] for e in events if e["event"] == "refused"})
    record["initialize_errors"] = sorted({e["detail"] for e in events if e["event"] == "error"})
    results = os.environ.get(RESULTS_ENV)
    if results:
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _outcomes.get(report.nodeid)
    if record is None or report.passed:
        return
    if report.skipped:
        record["outcome"] = "skipped"
        record["error"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
    else:
        record["outcome"] = "failed"
        lines = [line for line in str(report.longrepr).splitlines() if line.startswith("E ")]
        record["error"] = " / ".join(lines[-3:])[:600]
