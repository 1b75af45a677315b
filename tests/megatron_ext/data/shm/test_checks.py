"""Each check of the loader's opens on its own (owner, type, mode, links of the ring file and of
its private directory, and the shm_dir's own permissions): a refusal names the path and what is
wrong, comes at once, and neither the open nor the clean-up touches what it refused. Needs root
(files of another user); skipped otherwise. The attacks themselves: tests/megatron_ext/data/shm/test_security.py."""

import os
import shutil
import stat

import pytest

from megatron_ext.data.shm.ring import RingLayout
from megatron_ext.data.shm.segment import (
    RING,
    ShmSecurityError,
    create_segment,
    open_segment,
    remove_segment,
    remove_stale_segments,
    segment_path,
)
from tests.helpers.shm import ATTACKER
from tests.helpers.waits import hang_guard

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root")
LAYOUT = RingLayout(2, 2, 2, 32, 2)  # (slots, streams, mbs, seq_length, ranks): any ring will do


def _ring_variant(path, variant, attacker_uid, victim_file):
    os.mkdir(path, 0o700)
    ring = f"{path}/{RING}"
    if variant == "fifo":
        os.mkfifo(ring)
    elif variant == "symlink":
        os.symlink(victim_file, ring)
    else:
        with open(ring, "wb") as f:
            f.write(LAYOUT.header(os.getpid()))
        os.chmod(ring, 0o666 if variant == "mode" else 0o600)
        if variant == "links":
            os.link(ring, f"{path}/second-name")
        if variant == "owner":
            os.chown(ring, attacker_uid, -1)


@pytest.mark.parametrize(
    "variant,problem",
    [
        ("fifo", "it is a FIFO, not a regular file"),
        ("symlink", "it is a symlink, not a regular file"),
        ("mode", "its mode is 0666, not 0600"),
        ("links", "it has 2 hard links, not 1"),
        ("owner", "it is owned by uid \\d+ \\(.*\\), not by uid 0"),
    ],
)
def test_each_ring_check_names_the_file(users, shm_dir, tmp_path, variant, problem):
    victim_file = tmp_path / "precious"
    victim_file.write_bytes(b"x" * 8192)
    path = segment_path(shm_dir, "check", 0)
    _ring_variant(path, variant, users[ATTACKER][0], str(victim_file))
    # at once: a refusal, not a hang (opening a FIFO for reading blocks until a writer comes)
    refusal = f"refusing {path}/{RING} .*: {problem}.*remove it"
    with hang_guard(f"open_segment on a {variant} ring"), pytest.raises(ShmSecurityError, match=refusal):
        open_segment(path)
    assert victim_file.read_bytes() == b"x" * 8192


@pytest.mark.parametrize(
    "variant,problem",
    [
        ("symlink", "it is a symlink, not a directory"),
        ("file", "it is a regular file, not a directory"),
        ("mode", "its mode is 0755, not 0700"),
        ("owner", "it is owned by uid \\d+ \\(.*\\), not by uid 0"),
    ],
)
def test_each_directory_check_names_the_directory(users, shm_dir, variant, problem):
    path = segment_path(shm_dir, "check", 0)
    own = segment_path(shm_dir, "own", 0)
    held = create_segment(own, LAYOUT.size, LAYOUT.header(os.getpid()))  # live: the clean-up keeps it
    if variant == "symlink":
        os.symlink(own, path)
    elif variant == "file":
        open(path, "w").close()
    else:
        os.mkdir(path, 0o700)
        shutil.copy(f"{own}/{RING}", f"{path}/{RING}")
        os.chmod(path, 0o755 if variant == "mode" else 0o700)
        if variant == "owner":
            os.chown(path, users[ATTACKER][0], -1)
    with pytest.raises(ShmSecurityError, match=f"refusing {path} .*: {problem}"):
        open_segment(path)
    assert os.stat(path, follow_symlinks=False)  # refused, not removed
    assert remove_stale_segments(shm_dir) == []  # nor judged by the clean-up
    held.close()
    remove_segment(own)


def test_shm_dir_writable_by_others_without_sticky_bit_is_refused(shm_dir):
    os.chmod(shm_dir, 0o777)
    with pytest.raises(ShmSecurityError, match=rf"shm_dir='{shm_dir}' .*mode 0777.*sticky bit"):
        create_segment(segment_path(shm_dir, "x", 0), LAYOUT.size, LAYOUT.header(os.getpid()))
    assert os.listdir(shm_dir) == []
    assert stat.S_IMODE(os.stat(shm_dir).st_mode) == 0o777
