"""The start-up transport check on two recorded RCCL init logs (``tests/data/nccl/``, written in
NCCL's line format, ``host:pid:tid [device] NCCL INFO message``, from the messages of NCCL's,
RCCL's and aws-ofi-rccl's sources: one where the libfabric plugin loaded on Slingshot, one where
it did not and RCCL fell back to TCP sockets over the same interfaces). A job across nodes on
sockets beside a high-speed interface stops with one line, or warns where the user opts in."""

from __future__ import annotations

from pathlib import Path

import pytest

from mdsp_base.section import ConfigError
from megatron_ext.integration.transport import (
    ALLOW,
    Transport,
    TransportError,
    check_log,
    fast_interfaces,
    parse_init_log,
    spans_nodes,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "nccl"
OFI, SOCKET = DATA / "rccl-init-ofi.log", DATA / "rccl-init-socket.log"


@pytest.fixture
def frontier_node(tmp_path: Path) -> Path:
    """A /sys/class as on a Frontier node: 4 Slingshot interfaces and their Cassini devices."""
    for name in ("lo", "hsn0", "hsn1", "hsn2", "hsn3", "eth0"):
        (tmp_path / "net" / name).mkdir(parents=True)
    for name in ("cxi0", "cxi1", "cxi2", "cxi3"):
        (tmp_path / "cxi" / name).mkdir(parents=True)
    return tmp_path


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.delenv(ALLOW, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_the_logs_name_their_transport() -> None:
    assert parse_init_log(OFI.read_text()) == Transport("AWS Libfabric", "aws-ofi-rccl 1.4.0", ())
    assert parse_init_log(SOCKET.read_text()) == Transport("Socket", None, ("hsn0", "hsn1", "hsn2", "hsn3"))
    # a log cut before the communicator was made says nothing yet
    assert parse_init_log(OFI.read_text().split("NCCL INFO Using network")[0]) is None


def test_the_high_speed_interfaces_of_a_node(frontier_node: Path, tmp_path: Path) -> None:
    assert fast_interfaces(frontier_node) == [
        "hsn0",
        "hsn1",
        "hsn2",
        "hsn3",
        "cxi:cxi0",
        "cxi:cxi1",
        "cxi:cxi2",
        "cxi:cxi3",
    ]
    (tmp_path / "laptop" / "net" / "eth0").mkdir(parents=True)
    assert fast_interfaces(tmp_path / "laptop") == []


@pytest.mark.parametrize(
    ("env", "across"),
    [
        ({"SLURM_NNODES": "2"}, True),
        ({"SLURM_NNODES": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, False),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True),  # torchrun on two nodes
        ({}, False),
    ],
)
def test_a_job_spans_nodes(env: dict[str, str], across: bool) -> None:
    assert spans_nodes(env) is across


@pytest.mark.usefixtures("two_nodes")
def test_the_plugin_log_passes(frontier_node: Path, capsys: pytest.CaptureFixture[str]) -> None:
    check_log(OFI, frontier_node)
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("two_nodes")
def test_sockets_across_nodes_stop_the_job_with_one_line(frontier_node: Path) -> None:
    with pytest.raises(TransportError) as stop:
        check_log(SOCKET, frontier_node)
    line = str(stop.value)
    assert "\n" not in line and isinstance(stop.value, ConfigError)  # the job's one error: line, exit 2
    assert line.startswith("NCCL/RCCL runs this multi-node job over TCP sockets (hsn0, hsn1, hsn2, hsn3)")
    assert "aws-ofi-rccl" in line and line.endswith(f"{ALLOW}=1 runs it anyway")


@pytest.mark.usefixtures("two_nodes")
def test_the_user_may_go_on_under_a_loud_warning(
    frontier_node: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ALLOW, "1")
    check_log(SOCKET, frontier_node)
    err = capsys.readouterr().err
    assert err.startswith("WARNING: NCCL/RCCL runs this multi-node job over TCP sockets")
    assert f"going on because {ALLOW}=1" in err


def test_sockets_are_fine_on_one_node_or_without_a_fast_network(
    frontier_node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOW, raising=False)
    monkeypatch.setenv("SLURM_NNODES", "1")
    check_log(SOCKET, frontier_node)  # one node: RCCL's sockets carry nothing between nodes
    monkeypatch.setenv("SLURM_NNODES", "2")
    (tmp_path / "ethernet" / "net" / "eth0").mkdir(parents=True)
    check_log(SOCKET, tmp_path / "ethernet")  # sockets are all an Ethernet cluster has
