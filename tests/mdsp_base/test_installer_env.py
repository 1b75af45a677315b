"""An environment variable the installer sets is put back as it was when the installer closes."""

from __future__ import annotations

import os

import pytest

from mdsp_base.installer import Installer


def test_a_variable_the_user_set_gets_its_value_back_and_a_new_one_is_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MDSP_TEST_SET", "user")
    monkeypatch.delenv("MDSP_TEST_NEW", raising=False)
    with Installer() as installer:
        installer.setenv("test", "two variables", "MDSP_TEST_SET", "ours")
        installer.setenv("test", "two variables", "MDSP_TEST_NEW", "ours")
        assert os.environ["MDSP_TEST_SET"] == os.environ["MDSP_TEST_NEW"] == "ours"
        assert [c.what for c in installer.changes] == ["two variables", "two variables"]
    assert os.environ["MDSP_TEST_SET"] == "user"
    assert "MDSP_TEST_NEW" not in os.environ
