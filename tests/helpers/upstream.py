"""Upstream Megatron-LM and Megatron-DeepSpeed trees for the end-to-end tests, prepared once.

The trees come from ``../shared/upstream/*.tar.gz`` (beside the project; no network in CI). They
are unpacked into a cache outside the project (``$MEGATRON_EXT_UPSTREAM_CACHE``, default
``~/.cache/megatron-ext/upstream``), each once as shipped and once with ``patches/`` applied, and
each tree's own ``tools/preprocess_data.py`` builds its data set from one generated corpus; both
copies are compiled to bytecode (the ranks read it, whatever PYTHONDONTWRITEBYTECODE says). The
cache entry's name is a hash of the tarballs, the patches and this file: anything changed, a new
entry. A lock serialises concurrent test sessions; a finished entry is renamed into place whole.
"""

from __future__ import annotations

import compileall
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT.parent / "shared" / "upstream"
TARBALLS = {
    "megatron-lm": "Megatron-LM-core_v0.16.1.tar.gz",
    "megatron-deepspeed": "Megatron-DeepSpeed-4efb479.tar.gz",
}
PATCHES = {
    "megatron-lm": "megatron-lm-core_v0.16.1.patch",
    "megatron-deepspeed": "megatron-deepspeed-4efb479.patch",
}
# What upstream needs beyond the suite (module -> package), and the tools that build its dataset helper.
MODULES = {
    "transformers": "transformers",
    "yaml": "pyyaml",
    "triton": "triton",
    "pybind11": "pybind11",
    "nltk": "nltk",
    "six": "six",
}
TOOLS = ("g++", "make", "git")
LOCK_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 300.0


class SetupError(RuntimeError):
    """A prerequisite is missing or a preparation step failed; the message says which and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Tree:
    pristine: Path
    patched: Path
    data: str  # --data-path prefix


def missing_prerequisites() -> list[str]:
    """What the upstream runs need and this machine lacks, each with the fix."""
    import importlib.util

    problems = [
        f"{UPSTREAM / name} is missing (the upstream tarballs beside the project)"
        for name in TARBALLS.values()
        if not (UPSTREAM / name).is_file()
    ]
    problems += [
        f"python module {mod} is missing: bash scripts/setup_env.sh installs {pkg}"
        for mod, pkg in MODULES.items()
        if importlib.util.find_spec(mod) is None
    ]
    problems += [
        f"{tool} is not on PATH: .ci/run installs it (apt-get)"
        for tool in TOOLS
        if shutil.which(tool) is None
    ]
    return problems


def _digest() -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for name in [*TARBALLS.values()]:
        h.update((UPSTREAM / name).read_bytes())
    for name in PATCHES.values():
        h.update((ROOT / "patches" / name).read_bytes())
    return h.hexdigest()[:16]


def tool_env() -> dict[str, str]:
    """Upstream's helper Makefiles run ``python3``: make it this interpreter (it has pybind11)."""
    from megatron_ext.integration.launch import launch_env

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    return {**env, "PATH": launch_env(env)["PATH"], "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, env=tool_env(), capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise SetupError(f"{' '.join(cmd)} (in {cwd}) did not finish in {STEP_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        raise SetupError(
            f"{' '.join(cmd)} (in {cwd}) failed with {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )


def write_corpus(path: Path, documents: int = 400, seed: int = 0) -> None:
    """JSON lines whose text is token ids (what a NullTokenizer reads), ids below 250."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            n, start, step = int(rng.integers(20, 200)), int(rng.integers(0, 200)), int(rng.integers(1, 4))
            f.write(json.dumps({"text": " ".join(str((start + j * step) % 250) for j in range(n))}) + "\n")


def _helper_dir(kind: str) -> str:
    return "megatron/core/datasets" if kind == "megatron-lm" else "megatron/data"


def _build_tree(entry: Path, kind: str, corpus: Path) -> Tree:
    """One kind's pristine and patched trees, its dataset helper built, its data set from ``corpus``."""
    pristine, patched = entry / kind, entry / f"{kind}-patched"
    with tarfile.open(UPSTREAM / TARBALLS[kind]) as tar:
        tar.extractall(entry / f"unpacked-{kind}", filter="data")
    (top,) = (entry / f"unpacked-{kind}").iterdir()  # the archive holds one directory, the tree
    top.rename(pristine)
    # Compiled once here; the patched copy keeps the built helper (copy2 keeps times, make sees it current).
    _run(["make", "-C", _helper_dir(kind)], pristine)
    shutil.copytree(pristine, patched, copy_function=shutil.copy2)
    _run(["git", "apply", str(ROOT / "patches" / PATCHES[kind])], patched)
    prefix = entry / "data" / kind
    _run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(corpus),
            "--output-prefix",
            str(prefix),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "256",
            "--append-eod",
            "--workers",
            "1",
        ],
        pristine,
    )
    for tree in (pristine, patched):
        # Bytecode now, once: every rank imports the tree's modules from source, and a rank compiling
        # them itself (as with PYTHONDONTWRITEBYTECODE) spent 0.9-3.5 s of CPU on it (cProfile). What does not
        # compile with this Python (Megatron-LM has a 3.12 f-string) is not imported by the runs.
        compileall.compile_dir(tree, quiet=2, workers=1)
    return Tree(pristine, patched, f"{prefix}_text_document")


def _build(entry: Path) -> dict[str, Tree]:
    """Both kinds at once: each is a chain of single-threaded steps (make, preprocess_data.py), so
    two chains side by side take the time of the longer one on two cores, not the sum."""
    (entry / "data").mkdir(parents=True)
    corpus = entry / "data" / "corpus.jsonl"
    write_corpus(corpus)
    # Upstream's own SyntaxWarnings at compileall, not the tests'. Set here, around both threads:
    # the filters are the process's, and a catch_warnings in each thread would undo the other's.
    with warnings.catch_warnings(), ThreadPoolExecutor(len(TARBALLS)) as pool:
        warnings.simplefilter("ignore")
        futures = {kind: pool.submit(_build_tree, entry, kind, corpus) for kind in TARBALLS}
        return {kind: future.result() for kind, future in futures.items()}


def prepare() -> dict[str, Tree]:
    """The trees and data sets, from the cache or built now (bounded by LOCK_TIMEOUT_S)."""
    problems = missing_prerequisites()
    if problems:
        raise SetupError("; ".join(problems))
    cache = _cache()
    cache.mkdir(parents=True, exist_ok=True)
    entry = cache / _digest()
    with open(cache / ".lock", "w") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SetupError(
                        f"{cache / '.lock'} held for over {LOCK_TIMEOUT_S:.0f}s by another session"
                    ) from None
                time.sleep(1)
        if not entry.is_dir():
            partial = cache / f"{entry.name}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                _build(partial)
                partial.rename(entry)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return _trees(entry)


def _cache() -> Path:
    return Path(
        os.environ.get("MEGATRON_EXT_UPSTREAM_CACHE", Path.home() / ".cache" / "megatron-ext" / "upstream")
    )


def _trees(entry: Path) -> dict[str, Tree]:
    return {
        kind: Tree(entry / kind, entry / f"{kind}-patched", str(entry / "data" / kind) + "_text_document")
        for kind in TARBALLS
    }


def prepared() -> dict[str, Tree] | None:
    """The trees, if a session has prepared them already (entries are renamed into place whole);
    None where :func:`prepare` would build them or a prerequisite is missing."""
    if missing_prerequisites():
        return None
    entry = _cache() / _digest()
    return _trees(entry) if entry.is_dir() else None
