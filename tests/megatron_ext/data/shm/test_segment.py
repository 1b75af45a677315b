"""The segment's name, mode, space check and clean-up, the platform check, and the dataset check
at the entry point. Attacks by another local user: tests/megatron_ext/data/shm/test_security.py."""

import contextlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from mdsp_base.section import ConfigError
from mdsp_base.topology import Topology
from megatron_ext.data.batch import ALL_KEYS
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.indexed import DatasetFileError
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from megatron_ext.data.ordering import UnsupportedPlatformError
from megatron_ext.data.samplers import SamplerSettings
from megatron_ext.data.shm import segment as shm_segment
from megatron_ext.data.shm.node_loader import ShmBatchIterator
from megatron_ext.data.shm.ring import RingLayout
from megatron_ext.data.shm.segment import (
    RING,
    ShmSpaceError,
    create_segment,
    open_segment,
    remove_segment,
    remove_stale_segments,
    resolve_job_id,
    segment_path,
)
from megatron_ext.trainer.corpus import build_train_dataset, synthetic_documents, write_indexed_dataset
from tests.helpers.shm import dead_pid
from tests.helpers.waits import HANG_S

ROOT = str(Path(__file__).resolve().parents[4])
LAYOUT = RingLayout(slots=2, streams=1, micro_batch_size=2, seq_length=32, consumers=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm-segment")
    write_indexed_dataset(str(root / "corpus"), synthetic_documents(40))
    return root


def _job():
    return f"segtest{uuid.uuid4().hex[:8]}"


def test_name_carries_user_job_and_a_random_token(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert resolve_job_id() == "4242.3"
    assert resolve_job_id("my/job") == "my_job"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = resolve_job_id()
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert resolve_job_id() != first
    token = "0123456789abcdef" * 2
    assert (
        segment_path("/dev/shm", "J", 3, token)
        == f"/dev/shm/mdsp-{shm_segment.current_user()}-J-node3-{token}"
    )
    # the same settings never give the same name twice: nobody can guess it in advance
    assert segment_path("/dev/shm", "J", 3) != segment_path("/dev/shm", "J", 3)
    with pytest.raises(ValueError, match="not 32 lowercase hex digits"):
        segment_path("/dev/shm", "J", 3, "4242")


def test_segment_is_private_whatever_the_umask():
    path = segment_path("/dev/shm", _job(), 0)
    old = os.umask(0o277)  # would leave the directory 0500 and the ring 0400 without the explicit chmod
    try:
        mm = create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid()))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700 and stat.S_ISDIR(os.lstat(path).st_mode)
        ring = os.stat(os.path.join(path, RING))
        assert stat.S_IMODE(ring.st_mode) == 0o600 and ring.st_size == LAYOUT.size
        assert os.listdir(path) == [RING]  # the temporary name is gone
        other = open_segment(path)
        assert other is not None and other.mm[:16] == mm.mm[:16]
        other.close()
    finally:
        mm.close()
        remove_segment(path)
    assert not os.path.exists(path)


def _make(path, tmp_pid=None):
    """A private directory as a run of ours leaves it when killed: its ring, or a half-made one,
    locked by no one (the process that held the lock is gone)."""
    if tmp_pid is None:
        create_segment(path, LAYOUT.size, LAYOUT.header(12345)).close()
    else:
        os.mkdir(path, 0o700)
        os.close(os.open(os.path.join(path, f"{RING}.tmp{tmp_pid}"), os.O_CREAT | os.O_WRONLY, 0o600))


def test_dead_jobs_segments_are_removed_live_ones_kept(corpus):
    stale, half_made, live, fresh_empty, old_empty = (segment_path("/dev/shm", _job(), 0) for _ in range(5))
    _make(stale)
    _make(half_made, tmp_pid=dead_pid())
    held = create_segment(live, LAYOUT.size, LAYOUT.header(os.getpid()))  # its creator lives: locked
    os.mkdir(fresh_empty, 0o700)  # its creator is between mkdir and creating the ring
    os.mkdir(old_empty, 0o700)
    os.utime(old_empty, (time.time() - 3600, time.time() - 3600))
    try:
        removed = remove_stale_segments("/dev/shm")
        assert {stale, half_made, old_empty} <= set(removed) and not {live, fresh_empty} & set(removed)
        assert os.path.exists(os.path.join(live, RING)) and os.path.isdir(fresh_empty)
        assert not any(os.path.exists(p) for p in (stale, half_made, old_empty))
        # the loader's first rank does the same at start-up
        _make(stale)
        dataset = build_train_dataset(str(corpus / "corpus"), 32, 10, 1234, str(corpus / "cache"))
        it = ShmBatchIterator(
            dataset,
            SamplerSettings(2, 0, 1),
            keys=ALL_KEYS,
            config=ShmDataLoaderConfig(timeout_s=5),
            path=segment_path("/dev/shm", _job(), 0),
            local_index=0,
            node_dp_ranks=[0],
            rank=0,
        )
        assert not os.path.exists(stale)
        next(it)
        it.close()
    finally:
        held.close()
        remove_segment(live)
        os.rmdir(fresh_empty)


def test_space_is_checked_before_allocating(monkeypatch):
    monkeypatch.setattr(shm_segment, "free_bytes", lambda _: 1000)
    path = segment_path("/dev/shm", _job(), 0)
    with pytest.raises(
        ShmSpaceError, match=rf"needs {LAYOUT.size} bytes in /dev/shm but only 1000 bytes are free.*slots"
    ):
        create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid()))
    assert not [p for p in os.listdir("/dev/shm") if os.path.basename(path) in p]


@contextlib.contextmanager
def _tmpfs(mnt, options):
    """A tmpfs of its own at ``mnt`` (root only: skipped elsewhere), unmounted after the test."""
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_tmpfs_gives_a_clear_error_not_sigbus(tmp_path, monkeypatch):
    with _tmpfs(tmp_path / "tiny", "size=64k") as mnt:
        # pretend the probe saw room, so that posix_fallocate is the one to find the tmpfs full
        monkeypatch.setattr(shm_segment, "free_bytes", lambda _: 1 << 40)
        path = segment_path(str(mnt), _job(), 0)
        big = RingLayout(slots=4, streams=2, micro_batch_size=4, seq_length=1024, consumers=2)  # ~920 KB
        with pytest.raises(
            ShmSpaceError, match=rf"needs {big.size} bytes in {mnt} but only \d+ bytes are free"
        ):
            create_segment(path, big.size, big.header(os.getpid()))
        assert os.listdir(mnt) == []


def test_a_tmpfs_out_of_inodes_gives_a_clear_error(tmp_path):
    with _tmpfs(tmp_path / "few-inodes", "size=4m,nr_inodes=8") as mnt:
        taken = 0
        while True:  # use up every inode: bytes stay free, names do not
            try:
                (mnt / f"f{taken}").touch()
                taken += 1
            except OSError:
                break
        with pytest.raises(
            ShmSpaceError,
            match=rf"needs 2 inodes in {mnt} .a directory and its ring. but all \d+ are in use.*nr_inodes",
        ):
            create_segment(segment_path(str(mnt), _job(), 0), LAYOUT.size, LAYOUT.header(os.getpid()))
        assert len(os.listdir(mnt)) == taken  # nothing of ours left


def test_clean_up_looks_at_a_bounded_number_of_this_users_entries(tmp_path, monkeypatch):
    # Thousands of planted names must not make every start slow: only names of this user's are
    # looked at, a bounded number per start, and a real leftover among them is still removed.
    user = shm_segment.current_user()
    for i in range(300):
        (tmp_path / f"mdsp-{user}-decoy-{i}").mkdir(mode=0o755)  # wrong mode: never opened
        (tmp_path / f"mdsp-someone-else-{i}").mkdir(mode=0o700)
    stale = segment_path(str(tmp_path), _job(), 0)
    _make(stale)
    examined = []
    check = shm_segment.problem_with

    def counting(st, directory):
        examined.append(st)
        return check(st, directory=directory)

    monkeypatch.setattr(shm_segment, "problem_with", counting)
    starts = 0
    while os.path.exists(stale):
        examined.clear()
        shm_segment.remove_stale_segments(str(tmp_path))
        assert len(examined) <= shm_segment.STALE_CHECKS_PER_START
        starts += 1
        assert starts < 100, "the leftover was never reached"


def test_fewer_slots_than_pipeline_stages_are_refused_before_any_collective(corpus):
    dataset = build_train_dataset(str(corpus / "corpus"), 32, 10, 1234, str(corpus / "cache"))
    with pytest.raises(ConfigError, match=r"slots=2 is below the pipeline's 4 stages.*at least 4"):
        build_batch_iterator(  # no process group exists: a collective would fail otherwise
            dataset,
            LoaderSettings(
                micro_batch_size=2,
                consumed_samples=0,
                config=ShmDataLoaderConfig(enabled=True, slots=2),
                topology=Topology(world_size=1, ranks_per_node=1, ranks_per_package=1),
                tp_group=None,
                dp_rank=0,
                dp_size=1,
                pipeline_stages=4,
            ),
        )


@pytest.mark.parametrize("machine", ["ppc64le", "riscv64"])
def test_machines_whose_ordering_is_not_worked_out_are_refused(corpus, monkeypatch, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    dataset = build_train_dataset(str(corpus / "corpus"), 32, 10, 1234, str(corpus / "cache"))
    path = segment_path("/dev/shm", _job(), 0)
    with pytest.raises(
        UnsupportedPlatformError,
        match=rf"runs on x86_64, aarch64, and this machine is '{machine}'.*shm_data_loader.enabled=false",
    ):
        ShmBatchIterator(
            dataset,
            SamplerSettings(2, 0, 1),
            keys=ALL_KEYS,
            config=ShmDataLoaderConfig(timeout_s=5),
            path=path,
            local_index=0,
            node_dp_ranks=[0],
            rank=0,
        )
    assert not os.path.exists(path)
    # the entry point refuses before its collective (no process group exists here: it would fail otherwise)
    with pytest.raises(UnsupportedPlatformError, match=machine):
        build_batch_iterator(
            dataset,
            LoaderSettings(
                micro_batch_size=2,
                consumed_samples=0,
                config=ShmDataLoaderConfig(enabled=True),
                topology=Topology(world_size=1, ranks_per_node=1, ranks_per_package=1),
                tp_group=None,
                dp_rank=0,
                dp_size=1,
            ),
        )


def test_the_node_loader_without_the_jobs_topology_is_refused_before_any_collective(corpus, tmp_path):
    dataset = build_train_dataset(str(corpus / "corpus"), 32, 10, 1234, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"needs the job's topology: pass topology=detect_topology"):
        build_batch_iterator(
            dataset,
            LoaderSettings(
                micro_batch_size=2,
                consumed_samples=0,
                config=ShmDataLoaderConfig(enabled=True),
                topology=None,
                tp_group=None,
                dp_rank=0,
                dp_size=1,
            ),
        )


@pytest.mark.parametrize("damage,culprit", [("truncate_bin", ".bin"), ("corrupt_idx", ".idx")])
def test_corrupt_dataset_named_at_the_entry_point(corpus, tmp_path, damage, culprit):
    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(str(corpus / "corpus") + ext, prefix + ext)
    dataset = build_train_dataset(prefix, 32, 10, 1234, str(tmp_path / "cache"))
    if damage == "truncate_bin":
        os.truncate(prefix + ".bin", os.path.getsize(prefix + ".bin") // 2)
    else:
        with open(prefix + ".idx", "r+b") as f:
            f.write(b"garbage!!")
    with pytest.raises(DatasetFileError, match=prefix + culprit):
        build_batch_iterator(
            dataset,
            LoaderSettings(
                micro_batch_size=2,
                consumed_samples=0,
                config=ShmDataLoaderConfig(enabled=True),
                topology=Topology(world_size=1, ranks_per_node=1, ranks_per_package=1),
                tp_group=None,
                dp_rank=0,
                dp_size=1,
            ),
        )


def _creator_paused_before_its_lock(monkeypatch, path):
    """create_segment in a thread, stopped after its file exists and before it is locked (where any
    scheduler may preempt a rank); returns (thread, resume event, outcome)."""
    real_take_lock = shm_segment.take_lock
    created, resume, outcome = threading.Event(), threading.Event(), {}

    def slow_take_lock(fd, byte):
        created.set()
        resume.wait(HANG_S)
        return real_take_lock(fd, byte)

    monkeypatch.setattr(shm_segment, "take_lock", slow_take_lock)

    def create():
        try:
            outcome["segment"] = create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid()), peers=True)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=create)
    thread.start()
    assert created.wait(HANG_S) and os.listdir(path), "the creator's file"
    return thread, resume, outcome


@pytest.mark.parametrize("who", ["a waiting peer", "another job's clean-up"])
def test_a_creation_in_progress_is_neither_abandoned_nor_stale(monkeypatch, who):
    path = segment_path("/dev/shm", _job(), 0)
    thread, resume, outcome = _creator_paused_before_its_lock(monkeypatch, path)
    try:
        if who == "a waiting peer":
            assert not shm_segment.creation_abandoned(path)
        else:
            assert path not in remove_stale_segments("/dev/shm", limit=10**6)
    finally:
        resume.set()
        thread.join(HANG_S)
        if "segment" in outcome:
            outcome["segment"].close()
        remove_segment(path)
    assert "error" not in outcome, outcome  # the creation went on to completion


_WITHOUT_PROC = """
import os
from megatron_ext.data.shm.ring import RingLayout
from megatron_ext.data.shm.segment import create_segment, open_segment, remove_segment, segment_path
layout = RingLayout(2, 1, 2, 32, 2)
path = segment_path("/dev/shm", "noproc", 0)
mine = create_segment(path, layout.size, layout.header(os.getpid()), peers=True)
theirs = open_segment(path)
spare = mine.new_description()  # what the producer gets
assert theirs.held(0) and theirs.mm[:8] == mine.mm[:8]
os.close(spare); theirs.close(); mine.close(); remove_segment(path)
print("ok without /proc")
"""


def test_the_ring_needs_no_proc():
    # Some containers mount no /proc: creating, opening and handing over a ring must not need it.
    script = f"mount -t tmpfs none /proc && {sys.executable} -c '{_WITHOUT_PROC}'"
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, cwd=ROOT
    )
    if "mount:" in proc.stderr or "unshare:" in proc.stderr:
        pytest.skip(f"cannot hide /proc here (needs root): {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0 and "ok without /proc" in proc.stdout, proc.stderr[-3000:]
