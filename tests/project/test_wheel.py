"""The wheel installs the suite's own names only (no generic top-level module that could shadow a
user's), and carries the presets the recommendation CLI reads."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCE = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "results")


def test_the_wheel_installs_only_the_suites_packages_and_ships_the_presets(tmp_path):
    # Built from a copy: setuptools reuses a build/ folder, whose leftovers would enter the wheel.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"mdsp_base", "deepspeed_ext", "megatron_ext"}
    presets = {Path(name).name for name in names if name.startswith("mdsp_base/presets/")}
    assert {"gpt-20b-frontier.args", "ds_frontier_20b.json", "tiny-cpu.args"} <= presets
