"""How ``flash_overlap.backend`` is chosen, and what the layers say about NCCL waits.

p2p is the default: it keeps for backward what megatron-core keeps (``test_flash_overlap_memory.py``).
``auto`` takes torch's symmetric-memory ops only where every check passes (NCCL, a GPU torch
supports, the TP group within one node of the topology it is given, GPUs that reach each other peer
to peer, symmetric memory set up) and otherwise keeps p2p and logs why, whatever failed and however;
``symm_mem`` forced raises that reason. ``timeout_s`` bounds gloo waits only; a setting that makes
NCCL's waits block the host is warned about by name.

No GPU here: CUDA, the NCCL group and symmetric memory are stood in for at torch's boundary (device
queries, the group's backend, members and object all-gather, the symmetric-memory set-up calls);
the choice itself runs as in a job.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory

from mdsp_base.topology import Topology
from megatron_ext.layers import backend as backends
from megatron_ext.layers.backend import BackendUnavailableError, peer_problem, resolve_backend
from megatron_ext.layers.config import FlashOverlapConfig
from megatron_ext.layers.linear import FlashOverlapColumnParallelLinear
from megatron_ext.layers.p2p.link import OverlapGroup, check_nccl_waits
from tests.helpers.flash_overlap import FakeGroup

GPU0 = torch.device("cuda", 0)
ONE_NODE = Topology(world_size=2, ranks_per_node=2, ranks_per_package=1)


@pytest.fixture
def gpus(monkeypatch, caplog):
    """Two GPUs that reach each other, an NCCL group whose other rank reports what this one does
    from its own GPU (cuda:1), symmetric memory that sets up; returns the knobs and the log."""
    state = {"peer_access": True, "gathers": 0, "log": caplog}

    def all_gather_object(out: list, obj, group) -> None:
        state["gathers"] += 1
        out[:] = [(obj[0], rank) if isinstance(obj, tuple) else obj for rank in range(len(out))]

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: group.ranks)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: state["peer_access"])
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(_symmetric_memory, "enable_symm_mem_for_group", lambda name: None)
    monkeypatch.setattr(_symmetric_memory, "get_symm_mem_workspace", lambda name, min_size: None)
    monkeypatch.setattr(backends, "_logged", set())
    caplog.set_level(logging.INFO, logger=backends.__name__)
    return state


def _logged_reason(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    return line


def test_p2p_is_the_default_and_needs_no_probe(gpus):
    assert FlashOverlapConfig().backend == "p2p" and FlashOverlapColumnParallelLinear.overlap_backend == "p2p"
    assert resolve_backend("p2p", FakeGroup([0, 1]), GPU0, ONE_NODE) == "p2p"
    assert gpus["gathers"] == 0
    assert (
        _logged_reason(gpus["log"])
        == "Flash-Overlap backend: p2p (flash_overlap.backend=p2p: set by flash_overlap.backend)"
    )


def test_auto_takes_symm_mem_where_every_check_passes_and_says_what_it_costs(gpus):
    assert resolve_backend("auto", FakeGroup([0, 1]), GPU0, ONE_NODE) == "symm_mem"
    assert gpus["gathers"] == 3  # platform, peer access, set-up: each agreed by the group
    assert "the column layers keep their gathered input for backward, 2x what p2p keeps for qkv and fc1" in (
        _logged_reason(gpus["log"])
    )


def test_auto_keeps_p2p_when_the_group_spans_nodes_and_symm_mem_refuses(gpus):
    two_nodes = Topology(world_size=4, ranks_per_node=2, ranks_per_package=1)
    assert resolve_backend("auto", FakeGroup([1, 2]), GPU0, two_nodes) == "p2p"
    reason = "the tensor-parallel group [1, 2] spans nodes [0, 1] (2 ranks per node)"
    assert reason in _logged_reason(gpus["log"])
    assert gpus["gathers"] == 0  # the same on every rank: decided without talking
    with pytest.raises(BackendUnavailableError, match=r"symm_mem cannot run here: .*spans nodes \[0, 1\]"):
        resolve_backend("symm_mem", FakeGroup([1, 2]), GPU0, two_nodes)


def test_auto_without_a_topology_keeps_p2p_and_says_how_to_pass_one(gpus):
    assert resolve_backend("auto", FakeGroup([0, 1]), GPU0, None) == "p2p"
    assert "no topology was given" in _logged_reason(gpus["log"])
    assert "topology=mdsp_base.topology.detect_topology(...)" in _logged_reason(gpus["log"])


def test_auto_keeps_p2p_when_the_gpus_do_not_reach_each_other(gpus):
    gpus["peer_access"] = False
    assert resolve_backend("auto", FakeGroup([0, 1]), GPU0, ONE_NODE) == "p2p"
    assert "rank 0: cuda:0 has no peer-to-peer access to cuda:1" in _logged_reason(gpus["log"])


def test_peer_access_is_left_to_the_rendezvous_where_a_process_sees_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert peer_problem(GPU0, [0, 0]) is None  # every rank's only GPU is its cuda:0


@pytest.mark.parametrize("error", [RuntimeError, ValueError, NotImplementedError, OSError])
def test_auto_falls_back_on_any_setup_failure_and_logs_it(gpus, monkeypatch, error):
    def fail(name: str) -> None:
        raise error("no symmetric memory today")

    monkeypatch.setattr(_symmetric_memory, "enable_symm_mem_for_group", fail)
    assert resolve_backend("auto", FakeGroup([0, 1]), GPU0, ONE_NODE) == "p2p"
    assert (
        f"rank 0: setting up symmetric memory failed ({error.__name__}: no symmetric memory today)"
        in _logged_reason(gpus["log"])
    )


def test_auto_falls_back_when_the_probe_itself_fails(gpus, monkeypatch):
    def broken(out, obj, group):
        raise ConnectionError("peer closed the connection")

    monkeypatch.setattr(dist, "all_gather_object", broken)
    assert resolve_backend("auto", FakeGroup([0, 1]), GPU0, ONE_NODE) == "p2p"
    assert "probing the group failed (ConnectionError: peer closed the connection)" in _logged_reason(
        gpus["log"]
    )


@pytest.mark.parametrize("name", ["TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_blocking_nccl_waits_are_named(monkeypatch, name):
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setenv(name, "1")
    og = OverlapGroup(group=FakeGroup([0, 1]), name="fc1")
    with pytest.warns(RuntimeWarning, match=f"{name}=1 makes every wait of layer 'fc1' block the host"):
        check_nccl_waits(og, GPU0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_nccl_waits(og, torch.device("cpu"))  # gloo on CPU: waits are bounded by timeout_s
        monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
        check_nccl_waits(og, GPU0)
        monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
        monkeypatch.setenv(name, "0")
        check_nccl_waits(og, GPU0)


def test_timeout_s_is_documented_as_a_gloo_bound():
    timeout_doc = FlashOverlapConfig.model_fields["timeout_s"].description
    assert "gloo" in timeout_doc and "on NCCL the process group's own timeout applies" in timeout_doc


def test_blocking_nccl_waits_are_named_for_ulysses_attention_too(monkeypatch):
    from megatron_ext.layers.ulysses import HeadSplit
    from megatron_ext.layers.ulysses_module import UlyssesSelfAttention

    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.warns(RuntimeWarning, match="makes every wait of layer 'ulysses_attention' block the host"):
        UlyssesSelfAttention(8, HeadSplit(2, 2, 4, 2), lambda q, k, v, *a: q, FakeGroup([0, 1]))
