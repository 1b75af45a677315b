"""The segment's name, mode, space check and clean-up, and the dataset check at the entry point."""

import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import uuid

import pytest

from deepspeed_ext.config import ShmDataLoaderConfig
from megatron_ext.data import shm_segment
from megatron_ext.data.gpt_dataset import (
    DatasetFileError,
    build_train_dataset,
    synthetic_documents,
    write_indexed_dataset,
)
from megatron_ext.data.loader import build_batch_iterator
from megatron_ext.data.ring import RingLayout
from megatron_ext.data.shm_loader import ShmBatchIterator
from megatron_ext.data.shm_segment import (
    ShmSpaceError,
    create_segment,
    process_start_time,
    remove_stale_segments,
    resolve_job_id,
    segment_path,
)

LAYOUT = RingLayout(slots=2, streams=1, micro_batch_size=2, seq_length=32, consumers=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm-segment")
    write_indexed_dataset(str(root / "corpus"), synthetic_documents(40))
    return root


def _job():
    return f"segtest{uuid.uuid4().hex[:8]}"


def _dead_pid():
    proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    return proc.pid


def test_name_carries_user_and_job(monkeypatch):
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
    assert segment_path("/dev/shm", "J", 3) == f"/dev/shm/mdsp-{shm_segment.current_user()}-J-node3"


def test_segment_is_private_whatever_the_umask():
    path = segment_path("/dev/shm", _job(), 0)
    old = os.umask(0)
    try:
        mm = create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid(), process_start_time(os.getpid())))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert os.stat(path).st_size == LAYOUT.size
    finally:
        mm.close()
        os.unlink(path)


def test_dead_jobs_segments_are_removed_live_ones_kept(corpus):
    dead, me = _dead_pid(), os.getpid()
    stale = segment_path("/dev/shm", _job(), 0)
    half_made = segment_path("/dev/shm", _job(), 1) + f".tmp{dead}"
    live = segment_path("/dev/shm", _job(), 0)
    with open(stale, "wb") as f:
        f.write(LAYOUT.header(dead, 12345))
    open(half_made, "wb").close()
    with open(live, "wb") as f:
        f.write(LAYOUT.header(me, process_start_time(me)))
    try:
        removed = remove_stale_segments("/dev/shm")
        assert stale in removed and half_made in removed and live not in removed
        assert os.path.exists(live) and not os.path.exists(stale)
        # the loader's first rank does the same at start-up
        with open(stale, "wb") as f:
            f.write(LAYOUT.header(dead, 12345))
        dataset = build_train_dataset(str(corpus / "corpus"), 32, 10, 1234, str(corpus / "cache"))
        it = ShmBatchIterator(dataset, micro_batch_size=2, consumed_samples=0, config=ShmDataLoaderConfig(timeout_s=5),
                              path=segment_path("/dev/shm", _job(), 0), local_index=0, node_dp_ranks=[0], dp_size=1, rank=0)
        assert not os.path.exists(stale)
        next(it)
        it.close()
    finally:
        os.unlink(live)


def test_space_is_checked_before_allocating(monkeypatch):
    monkeypatch.setattr(shm_segment, "free_bytes", lambda _: 1000)
    path = segment_path("/dev/shm", _job(), 0)
    with pytest.raises(ShmSpaceError, match=rf"needs {LAYOUT.size} bytes in /dev/shm but only 1000 bytes are free.*slots"):
        create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid(), 1))
    assert not [p for p in os.listdir("/dev/shm") if os.path.basename(path) in p]


def test_full_tmpfs_gives_a_clear_error_not_sigbus(tmp_path, monkeypatch):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        # pretend the probe saw room, so that posix_fallocate is the one to find the tmpfs full
        monkeypatch.setattr(shm_segment, "free_bytes", lambda _: 1 << 40)
        path = segment_path(str(mnt), _job(), 0)
        big = RingLayout(slots=4, streams=2, micro_batch_size=4, seq_length=1024, consumers=2)  # ~920 KB
        with pytest.raises(ShmSpaceError, match=rf"needs {big.size} bytes in {mnt} but only \d+ bytes are free"):
            create_segment(path, big.size, big.header(os.getpid(), 1))
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


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
        build_batch_iterator(dataset, micro_batch_size=2, consumed_samples=0,
                             config=ShmDataLoaderConfig(enabled=True), topology=None, tp_group=None,
                             dp_rank=0, dp_size=1)
