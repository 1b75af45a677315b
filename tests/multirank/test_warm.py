"""``multirank.warm``: ranks forked from a warm interpreter get torchrun's variables, run their command
as ``python`` runs it, fail together, time out, and die with the server; the preload list holds only
what the interpreter's installation provides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from multirank import free_port
from multirank.warm import Rank, WarmLauncher, installed_modules

# What each rank records: its variables, how Python sees it, and that atexit ran at its exit.
RECORD = """
import atexit, json, os, sys
rank = os.environ["RANK"]
out = {"env": dict(os.environ), "path0": sys.path[0], "argv": sys.argv, "name": __name__}
json.dump(out, open(f"record-{rank}.json", "w"))
atexit.register(lambda: open(f"atexit-{rank}", "w").close())
code = int(os.environ.get("EXIT_RANK_" + rank, "0"))
if code:
    raise SystemExit(code)
"""
SLEEP = """
import os, time
open(f"pid-{os.environ['RANK']}", "w").write(str(os.getpid()))
if os.environ["RANK"] == "1":
    raise RuntimeError("rank 1 fails")
time.sleep(600)
"""


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    (tmp_path / "record.py").write_text(RECORD)
    (tmp_path / "sleep.py").write_text(SLEEP)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(RECORD)
    return tmp_path


@pytest.fixture
def warm(scripts: Path) -> Iterator[WarmLauncher]:
    launcher = WarmLauncher(dict(os.environ), discover=[[str(scripts / "record.py")]], cwd=scripts)
    yield launcher
    launcher.close()


def _records(where: Path, world: int) -> list[dict]:
    return [json.loads((where / f"record-{rank}.json").read_text()) for rank in range(world)]


def test_a_rank_gets_the_variables_torchrun_gives_its_workers(warm: WarmLauncher, scripts: Path) -> None:
    """Two torchrun agents (two emulated nodes of two ranks) against one warm launch of the same shape:
    the same variables with the same values, but for what only an agent has: the TCP store's host
    (torchrun's agent holds it; here rank 0 does), the agent's per-worker error file and the signals
    it forwards."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
            + [
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "record.py",
            ],
            cwd=scripts,
            env={**warm.env, "OMP_NUM_THREADS": "1"},
        )
        for node in range(2)
    ]
    assert [agent.wait(timeout=120) for agent in agents] == [0, 0]
    torchrun = _records(scripts, 4)
    codes = warm.launch(["record.py"], scripts, scripts / "log", nodes=2, per_node=2, port=port, timeout=60)
    assert codes == [0, 0, 0, 0], (scripts / "log").read_text()
    for theirs, ours in zip(torchrun, _records(scripts, 4)):
        added = {k: v for k, v in theirs["env"].items() if warm.env.get(k) != v}
        assert added.pop("TORCHELASTIC_USE_AGENT_STORE") == "True"
        assert added.pop("TORCHELASTIC_ERROR_FILE") and added.pop("TORCHELASTIC_SIGNALS_TO_HANDLE")
        assert ours["env"].pop("TORCHELASTIC_USE_AGENT_STORE") == "False"
        assert {k: v for k, v in ours["env"].items() if warm.env.get(k) != v} == added


def test_a_rank_runs_its_command_as_python_does(warm: WarmLauncher, scripts: Path) -> None:
    (scripts / "sub").mkdir()
    log = scripts / "log"
    assert warm.launch(["-m", "pkg"], scripts, log, 1, 2, free_port(), 60) == [0, 0]
    for record in _records(scripts, 2):
        assert record["name"] == "__main__"
        assert record["path0"] == str(scripts)  # python -m: the working directory first
        assert record["argv"][0] == str(scripts / "pkg" / "__main__.py")
    assert warm.launch([str(scripts / "record.py"), "x"], scripts / "sub", log, 1, 2, free_port(), 60) == [
        0,
        0,
    ]
    for record in _records(scripts / "sub", 2):
        assert record["path0"] == str(scripts)  # python script: the script's directory first
        assert record["argv"] == [str(scripts / "record.py"), "x"]
    assert (scripts / "sub" / "atexit-0").exists() and (scripts / "sub" / "atexit-1").exists()
    code = "import sys; open(f'c-{__name__}', 'w').write(repr([sys.path[0], sys.argv]))"
    assert warm.launch(["-c", code, "y"], scripts / "sub", log, 1, 1, free_port(), 60) == [0]
    assert (scripts / "sub" / "c-__main__").read_text() == repr(["", ["-c", "y"]])  # as python -c


def test_exit_codes_are_the_ranks_own(scripts: Path) -> None:
    env = {**os.environ, "EXIT_RANK_1": "7"}
    launcher = WarmLauncher(env, preload=["json"])
    try:
        codes = launcher.launch(["record.py"], scripts, scripts / "log", 1, 2, free_port(), 60)
    finally:
        launcher.close()
    assert codes == [0, 7]


def test_what_the_preload_printed_stays_out_of_the_ranks_output(scripts: Path) -> None:
    (scripts / "noisy.py").write_text("print('noisy was imported', end='')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # its stdout buffers
    launcher = WarmLauncher({**env, "PYTHONPATH": str(scripts)}, preload=["noisy"])
    try:
        assert launcher.launch(["record.py"], scripts, scripts / "log", 1, 2, free_port(), 60) == [0, 0]
    finally:
        launcher.close()
    assert "noisy" not in (scripts / "log").read_text()


def test_a_failing_rank_takes_its_peers_down_within_seconds(warm: WarmLauncher, scripts: Path) -> None:
    start = time.monotonic()
    codes = warm.launch(["sleep.py"], scripts, scripts / "log", 1, 3, free_port(), 300)
    assert codes[1] == 1 and codes[0] == codes[2] == -9, codes
    assert time.monotonic() - start < 30
    assert "RuntimeError: rank 1 fails" in (scripts / "log").read_text()


def test_a_launch_past_its_timeout_is_killed(warm: WarmLauncher, scripts: Path) -> None:
    (scripts / "sleep.py").write_text(SLEEP.replace('== "1"', '== "none"'))
    with pytest.raises(TimeoutError, match="still running after 2 s"):
        warm.launch(["sleep.py"], scripts, scripts / "log", 1, 2, free_port(), 2)
    pids = [int((scripts / f"pid-{rank}").read_text()) for rank in range(2)]
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def test_a_rank_that_cannot_join_its_network_namespace_fails_naming_it(
    warm: WarmLauncher, scripts: Path
) -> None:
    ranks = [
        Rank(scripts / f"log-{r}", {"RANK": str(r)}, netns) for r, netns in enumerate((None, "no-such-ns"))
    ]
    assert warm.run(["-c", "print('the command ran')"], scripts, ranks, 30) == [0, 1]
    assert (scripts / "log-0").read_text() == "the command ran\n"
    failed = (scripts / "log-1").read_text()
    assert "/var/run/netns/no-such-ns" in failed and "the command ran" not in failed


def test_the_ranks_die_with_the_server(warm: WarmLauncher, scripts: Path) -> None:
    (scripts / "sleep.py").write_text(SLEEP.replace('== "1"', '== "none"'))
    server = warm._server
    request = {"argv": ["sleep.py"], "cwd": str(scripts), "timeout": 600}
    request["ranks"] = [{"env": {"RANK": "0"}, "log": str(scripts / "log"), "netns": None}]
    assert server.stdin is not None
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    deadline = time.monotonic() + 30
    while not (scripts / "pid-0").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int((scripts / "pid-0").read_text())
    warm.close()
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_only_installed_packages_are_preloaded(scripts: Path) -> None:
    (scripts / "local_mod.py").write_text("")
    (scripts / "uses.py").write_text("import local_mod, json, numpy\n")
    (scripts / "loaded.py").write_text(
        "import json, sys\njson.dump([m in sys.modules for m in ('numpy', 'local_mod')], open('loaded.json', 'w'))\n"
    )
    with WarmLauncher(dict(os.environ), discover=[["uses.py"]], cwd=scripts) as launcher:
        assert launcher.launch(["loaded.py"], scripts, scripts / "log", 1, 1, free_port(), 60) == [0]
    assert json.loads((scripts / "loaded.json").read_text()) == [True, False]
    # what a later launcher may preload instead of discovering: numpy, not the server's own json
    assert "numpy" in launcher.discovered and not {"local_mod", "json"} & set(launcher.discovered)
    site = os.path.join(sys.prefix, "lib", "x.py")
    modules = {
        "shadowed": types.SimpleNamespace(__file__=str(scripts / "shadowed" / "__init__.py")),
        "shadowed.sub": types.SimpleNamespace(__file__=site),  # the same package found installed
        "kept": types.SimpleNamespace(__file__=site),
        "stand_in": types.SimpleNamespace(),  # no file: never imported by name
    }
    assert installed_modules(modules) == ["kept"]


def test_a_server_that_would_fork_threads_refuses(tmp_path: Path) -> None:
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "multirank.warm_server"],
        input=json.dumps({"preload": ["threaded"], "discover": [], "cwd": str(tmp_path), "timeout": 60})
        + "\n",
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "importing threaded started a thread (2 in all)" in json.loads(done.stdout)["error"]


def test_the_server_imports_in_the_background_and_the_first_launch_waits_for_it(scripts: Path) -> None:
    """The constructor returns while the preload still runs; the first launch waits for it, and a
    server that cannot fork ranks makes that launch raise, naming why."""
    (scripts / "slow.py").write_text("import time\ntime.sleep(2)\n")
    (scripts / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(scripts)}
    start = time.monotonic()
    with WarmLauncher(env, preload=["slow"]) as launcher:
        assert time.monotonic() - start < 1.5, "the constructor waited for the preload"
        assert launcher.launch(["record.py"], scripts, scripts / "log", 1, 1, free_port(), 60) == [0]
        assert time.monotonic() - start >= 2.0, "a rank ran before the preload had finished"
    launcher = WarmLauncher(env, preload=["threaded"])
    with pytest.raises(RuntimeError, match="importing threaded started a thread"):
        launcher.launch(["record.py"], scripts, scripts / "log", 1, 1, free_port(), 60)
