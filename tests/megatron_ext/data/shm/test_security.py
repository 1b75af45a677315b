"""Attacks by another local user on the shared-memory loader. The test creates that user (and a
non-root victim user) with ``useradd`` and runs the attacker's actions in a child forked with its
uid; the victim job runs on gloo across two local processes. Every attack must end at once with an
error naming the planted path (or, for leftovers, be ignored without touching them): never a hang,
never a batch the attacker wrote. Needs root (to create users); skipped otherwise. Each check on
its own: tests/megatron_ext/data/shm/test_checks.py."""

import mmap
import os
import select
import signal
import traceback
import uuid

import pytest
import torch
import torch.distributed as dist

from mdsp_base.topology import Topology
from megatron_ext.data import loader as loader_module
from megatron_ext.data.config import ShmDataLoaderConfig
from megatron_ext.data.loader import LoaderSettings, build_batch_iterator
from megatron_ext.data.shm import ring as ring_module
from megatron_ext.data.shm.segment import (
    RING,
    create_segment,
    current_user,
    open_segment,
    remove_segment,
    remove_stale_segments,
    segment_path,
)
from megatron_ext.data.shm.segment_file import OWNER_LOCK, SegmentFile
from megatron_ext.trainer.corpus import build_train_dataset
from tests.helpers.megatron_samplers import megatron_order
from tests.helpers.shm import ATTACKER, VICTIM, dead_pid

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creating a second local user needs root")

SEQ, MBS, RANKS, SLOTS = 32, 2, 2, 2
LAYOUT = ring_module.RingLayout(SLOTS, RANKS, MBS, SEQ, RANKS)  # what the victim job's ring looks like
TIMEOUT_S = 30.0  # the loader's own timeout: every attack must end with a refusal, not with it
FORGED = 7  # every token the attacker writes
NEW_TOKEN = loader_module.new_token
JOB = "sec"  # the job label of the victim's segment names


def as_user(ids, fn, *args, stay=False):
    """Run ``fn(*args)`` in a child forked under ``ids`` = (uid, gid); returns its pid once ``fn``
    returned. ``stay``: the child then lives on (the owner of a forged ring) until killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(ids[1])
            os.setuid(ids[0])
            fn(*args)
            os.write(w, b"ok")
            code = 0
            if stay:
                signal.pause()  # until reap() kills it
        except BaseException:
            os.write(w, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(w)
    ready, _, _ = select.select([r], [], [], 30)
    out = os.read(r, 65536) if ready else b"no answer within 30 s"
    os.close(r)
    if not stay or out != b"ok":
        reap(pid)
    assert out == b"ok", f"the child as uid {ids[0]} failed: {out.decode()}"
    return pid


def reap(pid):
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


# -- what the attacker does (in the forked child, as the attacker) ---------------------------------
def _plant_leftovers(shm_dir, victims, victim_file, dead):
    """Entries named like the victims' segments: the empty ``.tmp<deadpid>`` file that blocked every
    later job, a FIFO (the old clean-up opened it and hung), a symlink to a victim's file, and a
    private-looking directory with a dead owner's ring."""
    for victim in victims:
        open(f"{shm_dir}/mdsp-{victim}-x.tmp{dead}", "w").close()
        os.mkfifo(f"{shm_dir}/mdsp-{victim}-job-train-node0")
        os.symlink(victim_file, f"{shm_dir}/mdsp-{victim}-link")
        fake = f"{shm_dir}/mdsp-{victim}-fake-node0-{'0' * 32}"
        os.mkdir(fake, 0o700)
        with open(f"{fake}/{RING}", "wb") as f:
            f.write(LAYOUT.header(dead))


def _plant_forged_ring(path):
    """A ring at the victim's segment name as a valid producer would publish it, with forged
    batches, owned (and kept alive) by the attacker, open to everyone."""
    os.mkdir(path)
    os.chmod(path, 0o777)
    fd = os.open(f"{path}/{RING}", os.O_CREAT | os.O_RDWR, 0o666)
    os.fchmod(fd, 0o666)
    os.ftruncate(fd, LAYOUT.size)
    mm = mmap.mmap(fd, LAYOUT.size)
    mm[: LAYOUT.data_offset] = LAYOUT.header(os.getpid())
    forged = ring_module.Ring(SegmentFile(fd, mm), LAYOUT)
    forged.segment.lock(OWNER_LOCK)
    forged.lock_for_producer(fd)
    forged.start_producer(os.getpid())
    for slot in range(SLOTS):
        for stream in range(RANKS):
            forged.tokens(slot, stream)[...] = FORGED
            forged.seal(slot, stream)
        forged.publish(slot, slot)
    forged.close()


# -- the victim job (gloo ranks) -------------------------------------------------------------------
def _load(prefix, cache, shm_dir, token=None, steps=3):
    """One loader on every rank; its batches checked against the dataset, or the error it raised."""
    dataset = build_train_dataset(prefix, SEQ, 10, 1234, cache)
    rank = dist.get_rank()
    if token is not None:  # stands for an attacker who learnt the name in advance
        loader_module.new_token = lambda: token
    try:
        it = build_batch_iterator(
            dataset,
            LoaderSettings(
                micro_batch_size=MBS,
                consumed_samples=0,
                topology=Topology(world_size=RANKS, ranks_per_node=RANKS, ranks_per_package=1),
                tp_group=None,
                job_id=JOB,
                config=ShmDataLoaderConfig(enabled=True, slots=SLOTS, timeout_s=TIMEOUT_S, shm_dir=shm_dir),
                dp_rank=rank,
                dp_size=RANKS,
            ),
        )
        try:
            got = [next(it) for _ in range(steps)]
        finally:
            it.close()
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {e}")
    finally:
        loader_module.new_token = NEW_TOKEN
    indices = megatron_order("single", len(dataset), 0, MBS, rank, RANKS)  # build_batch_iterator's default
    for batch, idx in zip(got, indices):
        expected = torch.stack([torch.as_tensor(dataset[i]["tokens"]) for i in idx])
        assert torch.equal(batch["tokens"], expected), f"rank {rank} got tokens the dataset does not hold"
    return dict(error=None, path=it.path)


def _refused_naming(results, path):
    """Every rank refused the planted path by name, at once: not after its timeout (whose message
    names shm_data_loader.timeout_s), nor by a hang (the pool's call timeout, above it, names that)."""
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} took batches from a planted segment"
        assert path in res["error"], f"rank {rank}: {res['error']}"
        assert "shm_data_loader.timeout_s" not in res["error"], (
            f"rank {rank} waited for its timeout: {res['error']}"
        )


# -- the attacks -----------------------------------------------------------------------------------
def test_planted_leftovers_neither_block_nor_hang_and_stay_untouched(
    run_ranks, small_corpus, users, shm_dir, tmp_path
):
    victim_file = tmp_path / "precious"
    victim_file.write_bytes(b"the victim's own data\n")
    as_user(
        users[ATTACKER], _plant_leftovers, shm_dir, [current_user(), VICTIM], str(victim_file), dead_pid()
    )
    planted = sorted(os.listdir(shm_dir))
    results = run_ranks(RANKS, _load, *small_corpus, shm_dir, timeout=60)
    assert [r["error"] for r in results] == [None, None]
    assert (
        sorted(os.listdir(shm_dir)) == planted
    )  # the job's own directory is gone, the attacker's entries stay
    assert victim_file.read_bytes() == b"the victim's own data\n"
    # the name is new on every run: nothing to plant in advance
    again = run_ranks(RANKS, _load, *small_corpus, shm_dir, timeout=60)
    assert results[0]["path"] == results[1]["path"] != again[0]["path"]
    # a non-root victim (whom the old clean-up's unlink failed with PermissionError) runs its clean-up
    # and a whole segment life cycle in the same directory
    as_user(users[VICTIM], _victim_lifecycle, shm_dir)
    assert sorted(os.listdir(shm_dir)) == planted


def _victim_lifecycle(shm_dir):
    assert remove_stale_segments(shm_dir) == []
    path = segment_path(shm_dir, "victim", 0)
    mm = create_segment(path, LAYOUT.size, LAYOUT.header(os.getpid()))
    other = open_segment(path)
    assert other is not None and other.mm[:8] == mm.mm[:8]
    remove_segment(path)
    other.close()
    mm.close()


def test_fifo_at_the_segment_name_fails_at_once(run_ranks, small_corpus, users, shm_dir):
    token = uuid.uuid4().hex
    path = segment_path(shm_dir, f"{JOB}-train", 0, token)
    as_user(users[ATTACKER], os.mkfifo, path, 0o666)
    results = run_ranks(RANKS, _load, *small_corpus, shm_dir, token, timeout=60)
    _refused_naming(results, path)
    assert "existed before" in results[0]["error"]
    assert "it is a FIFO, not a directory" in results[1]["error"]


def test_forged_segment_of_another_user_is_refused(run_ranks, small_corpus, users, shm_dir):
    token = uuid.uuid4().hex
    path = segment_path(shm_dir, f"{JOB}-train", 0, token)
    owner = as_user(users[ATTACKER], _plant_forged_ring, path, stay=True)
    try:
        results = run_ranks(RANKS, _load, *small_corpus, shm_dir, token, timeout=60)
    finally:
        reap(owner)
    _refused_naming(results, path)
    assert f"owned by uid {users[ATTACKER][0]} (" in results[1]["error"]


def test_symlink_to_the_victims_own_segment_is_not_followed(run_ranks, small_corpus, users, shm_dir):
    # The victim's own live segment of another job: following the link would register this job's
    # ranks in it (a write) and wait there for batches that never come.
    own = segment_path(shm_dir, "other-job", 0)
    mm = create_segment(own, LAYOUT.size, LAYOUT.header(os.getpid()))
    before = bytes(mm.mm)
    token = uuid.uuid4().hex
    path = segment_path(shm_dir, f"{JOB}-train", 0, token)
    try:
        as_user(users[ATTACKER], os.symlink, own, path)
        results = run_ranks(RANKS, _load, *small_corpus, shm_dir, token, timeout=60)
        _refused_naming(results, path)
        assert "it is a symlink, not a directory" in results[1]["error"]
        assert bytes(mm.mm) == before, "the victim's own segment was written through the link"
    finally:
        mm.close()
        remove_segment(own)
