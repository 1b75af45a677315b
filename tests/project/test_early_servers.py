"""``tests.helpers.early``: a whole-suite session starts its warm servers as it starts; any other
(a file, a filter, a collection only) starts them when a test first needs them; a server no selected
test needs is stopped as collection ends."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests.helpers import early

ROOT = Path(__file__).resolve().parents[2]


def _config(
    args: list[str], cwd: Path = ROOT, markexpr: str = "", keyword: str = "", collectonly: bool = False
):
    option = types.SimpleNamespace(markexpr=markexpr, keyword=keyword, collectonly=collectonly)
    stash = pytest.Stash()
    return types.SimpleNamespace(
        option=option, args=args, invocation_params=types.SimpleNamespace(dir=cwd), stash=stash
    )


@pytest.mark.parametrize(
    ("args", "cwd", "filters", "starts"),
    [
        (["tests"], ROOT, {}, True),  # `pytest` in the root: the testpaths
        (["."], ROOT / "tests", {}, True),
        ([str(ROOT)], Path("/"), {}, True),
        (["tests/multirank/test_warm.py"], ROOT, {}, False),
        (["tests/megatron_ext"], ROOT, {}, False),
        (["tests"], ROOT, {"markexpr": "numeric"}, False),  # the AVX2 pass
        (["tests"], ROOT, {"keyword": "warm"}, False),
        (["tests"], ROOT, {"collectonly": True}, False),
    ],
)
def test_only_a_whole_unfiltered_suite_starts_early(args, cwd, filters, starts) -> None:
    assert early.starts_early(_config(args, cwd, **filters)) is starts


class _Server:
    """What the helper does with a server: it closes it."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_fixture_takes_its_early_server_and_an_unused_one_is_stopped() -> None:
    config = _config(["tests"])
    used, unused = _Server(), _Server()
    early.start_early(config, "used_warm", lambda: used)
    early.start_early(config, "unused_warm", lambda: unused)
    early.start_early(config, "none_warm", lambda: None)
    item = types.SimpleNamespace(fixturenames=["tmp_path", "used_warm"])
    early.pytest_collection_finish(types.SimpleNamespace(config=config, items=[item]))
    assert unused.closed and not used.closed
    assert early.take(config, "used_warm", _Server) is used
    made = early.take(config, "used_warm", _Server)
    assert made is not used, "a second take starts a server of its own"


def test_a_server_no_fixture_took_is_closed_at_the_end() -> None:
    config = _config(["tests"])
    server = _Server()
    early.start_early(config, "used_warm", lambda: server)
    early.pytest_sessionfinish(types.SimpleNamespace(config=config))
    assert server.closed


def test_without_the_upstream_tarballs_no_upstream_server_starts(monkeypatch, tmp_path) -> None:
    from tests.helpers import upstream, upstream_warm

    monkeypatch.setattr(upstream, "UPSTREAM", tmp_path)  # an empty directory: no tarballs
    assert upstream.prepared() is None
    config = _config(["tests"])
    upstream_warm.pytest_sessionstart(types.SimpleNamespace(config=config))
    assert isinstance(early.take(config, upstream_warm.FIXTURE, _Server), _Server), "nothing was started"


def test_the_kept_import_list_is_keyed_alike_with_and_without_the_projects_egg_info(
    monkeypatch, tmp_path
) -> None:
    """A checkout where ``pip install -e`` left an egg-info on the path and one without it (a worktree)
    share the upstream runs' kept import list: the same installation, the same key."""
    import sys

    from tests.helpers import upstream_warm

    without = upstream_warm._installed()
    (tmp_path / "megatron_deepspeed_plugins.egg-info").mkdir()
    (tmp_path / "megatron_deepspeed_plugins.egg-info" / "PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: megatron-deepspeed-plugins\nVersion: 0.1.0\n"
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert upstream_warm._installed() == without
