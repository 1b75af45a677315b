"""The node's shared-memory segment: a private directory, the ring file in it, the space it needs,
and the clean-up of killed runs' leftovers.

Layout: ``{shm_dir}/mdsp-{user}-{label}-node{n}-{token}/ring``, the directory mode 0700 with a
128-bit token no other user can guess, every open through ``private``. The ring is created as a
temporary file, locked, sized with ``posix_fallocate`` (a full tmpfs fails at once, not with a
SIGBUS later) and renamed once its header is written; it is mapped with ``mmap``, not
``multiprocessing.shared_memory``, whose resource tracker may unlink a live segment. A leftover is
stale when no one holds a lock on its files (``segment_file``). Docs: docs/shm_data_loader.md, "Security".
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import re
import secrets
import struct
import time

from mdsp_base.section import ConfigError
from megatron_ext.data.shm.private import (
    SAFE_OPEN,
    ShmSecurityError,
    check_shm_dir,
    current_user,
    open_checked,
    problem_with,
    refusal,
)
from megatron_ext.data.shm.segment_file import OWNER_LOCK, SegmentFile, lock_holder, map_apart, take_lock

PREFIX = "mdsp"
RING = "ring"  # the segment's file inside its private directory
ABANDONED = ".abandoned"  # suffix of a segment whose first rank failed, left as a marker for its peers
MAGIC = 0x4D44535052494E47  # "MDSPRING": marks a header this module wrote
EMPTY_DIR_GRACE_S = 60.0  # an empty private dir older than this lost its creator between two calls
STALE_CHECKS_PER_START = 64  # entries a start inspects for leftovers (each costs a few syscalls)


class ShmSpaceError(ConfigError):
    """The ring does not fit in the shared-memory directory; the message gives both sizes."""


def resolve_job_id(explicit: str | None = None) -> str:
    """A readable label for the segment's name: ``explicit``, else Slurm's job (and step) id, else a
    hash of the rendezvous variables. Only the node's first rank's label is used (the loader shares
    it with the token), and the name's uniqueness comes from the random token alone."""
    if explicit:
        raw = explicit
    elif os.environ.get("SLURM_JOB_ID"):
        raw = os.environ["SLURM_JOB_ID"] + "." + os.environ.get("SLURM_STEP_ID", "0")
    else:
        keys = [os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")]
        raw = hashlib.sha1("|".join(keys).encode()).hexdigest()[:12]
    return re.sub(r"[^A-Za-z0-9_.]", "_", raw)


def new_token() -> str:
    """128 bits from the OS's cryptographic generator: a name no other user can guess."""
    return secrets.token_hex(16)


def segment_path(shm_dir: str, label: str, node: int, token: str | None = None) -> str:
    """The private directory of one node's ring. Every rank of the node must pass the same
    ``token`` (the node's first rank draws it); None draws a fresh one, for a single process."""
    token = new_token() if token is None else token
    if not re.fullmatch(r"[0-9a-f]{32}", token):
        raise ValueError(f"segment token {token!r} is not 32 lowercase hex digits: draw it with new_token()")
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    return os.path.join(shm_dir, f"{PREFIX}-{current_user()}-{label}-node{node}-{token}")


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged writer may still allocate in ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


# -- clean-up ------------------------------------------------------------------------------------
def remove_stale_segments(shm_dir: str, limit: int = STALE_CHECKS_PER_START) -> list[str]:
    """Remove this user's private directories whose owner process is gone (a killed job); returns
    their paths. Only entries named as this user's are looked at, at most ``limit`` of them, drawn
    at random: a start costs the same whatever others planted in the directory, and leftovers that
    one start does not reach, a later one does. Anything that is not this user's own (other users'
    entries under our name, symlinks, FIFOs, files) is skipped unopened."""
    removed = []
    mine = f"{PREFIX}-{current_user()}-"
    with os.scandir(shm_dir) as scan:
        entries = [e for e in scan if e.name.startswith(mine)]
    if len(entries) > limit:
        entries = random.sample(entries, limit)
    for entry in entries:
        try:
            if problem_with(entry.stat(follow_symlinks=False), directory=True):
                continue  # not ours: never opened, never judged
            dfd = open_checked(entry.path, os.O_RDONLY, directory=True)
        except (OSError, ShmSecurityError):  # gone or swapped since the scan
            continue
        if dfd is None:
            continue
        try:
            if _is_stale(dfd):
                for name in os.listdir(dfd):
                    os.unlink(name, dir_fd=dfd)
                os.rmdir(entry.path)
                removed.append(entry.path)
        except (OSError, ShmSecurityError):  # in use again, or removed by another run's clean-up
            pass
        finally:
            os.close(dfd)
    return removed


def _is_stale(dfd: int) -> bool:
    """No one holds a lock on any of the directory's files (its ring, or an unfinished ``ring.tmp*``)."""
    names = os.listdir(dfd)
    if not names:  # its creator sits between mkdir and creating the ring (microseconds) or died there
        return time.time() - os.fstat(dfd).st_mtime > EMPTY_DIR_GRACE_S
    for name in names:
        if not re.fullmatch(re.escape(RING) + r"(\.(tmp|new)\d+)?", name):
            return False  # not a file this module makes: left to whoever made it
        if name.startswith(RING + ".new") and time.time() - os.fstat(dfd).st_mtime <= EMPTY_DIR_GRACE_S:
            return False  # being made: its creator locks it within microseconds, or died there
        fd = open_checked(name, os.O_RDONLY, directory=False, dir_fd=dfd)
        if fd is None:
            return False  # renamed or removed since the listing: someone is at work on it
        try:
            if name == RING and struct.unpack("q", os.pread(fd, 8, 0).ljust(8, b"\0"))[0] != MAGIC:
                return False
            if lock_holder(fd, 0, 0):
                return False
        finally:
            os.close(fd)
    return True


# -- life cycle ----------------------------------------------------------------------------------
def create_segment(path: str, size: int, header: bytes, peers: bool = False) -> SegmentFile:
    """Create the private directory ``path`` (0700) holding the ring (0600, ``size`` bytes starting
    with ``header``), mapped read-write, its byte :data:`OWNER_LOCK` locked by this process. The
    file is locked before its space is reserved, the space before anything is written.

    ``peers``: other processes wait for this ring. A failed creation then leaves the directory and
    its unfinished, unlocked ``ring.tmp*`` behind, so they see at once that it was abandoned
    (:func:`creation_abandoned`) instead of waiting for their timeout; they remove it."""
    shm_dir = os.path.dirname(path)
    check_shm_dir(shm_dir)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise refusal(
            path, "it existed before this job's first rank created it (its name is random)"
        ) from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ShmSpaceError(space_message(shm_dir, size, free_bytes(shm_dir))) from None
        raise
    fd = -1
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | SAFE_OPEN)
        try:
            os.fchmod(dfd, 0o700)  # the umask may have cleared bits
            if problem := problem_with(os.fstat(dfd), directory=True):
                raise refusal(path, problem)
            fd = _open_locked_tmp(dfd, path, size)
            return SegmentFile(fd, _fill_ring(dfd, fd, path, size, header), os.path.join(path, RING))
        finally:
            os.close(dfd)
    except BaseException:
        if fd >= 0:
            os.close(fd)  # drops the lock: peers see the creation abandoned
        if not peers or fd < 0:
            remove_segment(path)
        raise


def _open_locked_tmp(dfd: int, path: str, size: int) -> int:
    """Make ``ring.tmp<pid>``, locked before it has that name: it is made as ``ring.new<pid>`` and
    renamed once locked (the lock stays with the open file description), so a peer or a clean-up
    never finds a ``ring.tmp*`` without its creator's lock, which would mean "abandoned"."""
    shm_dir, new, tmp = os.path.dirname(path), f"{RING}.new{os.getpid()}", f"{RING}.tmp{os.getpid()}"
    try:
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | SAFE_OPEN, 0o600, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ShmSpaceError(space_message(shm_dir, size, free_bytes(shm_dir))) from None
        raise
    try:
        os.fchmod(fd, 0o600)  # the umask may have cleared bits
        if problem := problem_with(os.fstat(fd), directory=False):
            raise refusal(f"{path}/{tmp}", problem)
        if not take_lock(fd, OWNER_LOCK):
            raise refusal(f"{path}/{new}", "another process locked it the moment it was created")
        _rename(dfd, path, new, tmp)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fill_ring(dfd: int, fd: int, path: str, size: int, header: bytes) -> mmap.mmap:
    shm_dir = os.path.dirname(path)
    available = free_bytes(shm_dir)
    if size > available:
        raise ShmSpaceError(space_message(shm_dir, size, available))
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise ShmSpaceError(space_message(shm_dir, size, free_bytes(shm_dir))) from None
        raise
    mm = map_apart(dfd, f"{RING}.tmp{os.getpid()}", fd, size)
    mm[: len(header)] = header
    _rename(dfd, path, f"{RING}.tmp{os.getpid()}", RING)
    return mm


def _rename(dfd: int, path: str, old: str, new: str) -> None:
    try:
        os.rename(old, new, src_dir_fd=dfd, dst_dir_fd=dfd)
    except FileNotFoundError:
        raise RuntimeError(
            f"{path}/{old} was removed while this rank created it: another process of user {current_user()} "
            "removed the segment (a clean-up that took it for a leftover, or a peer that gave up on it); "
            "check for several jobs sharing one job id and shm_dir"
        ) from None


def open_segment(path: str) -> SegmentFile | None:
    """Map the ring of the private directory ``path`` read-write; None while it does not exist yet.
    Raises :class:`ShmSecurityError` naming the culprit when either is not this user's own."""
    dfd = open_checked(path, os.O_RDONLY, directory=True)
    if dfd is None:
        return None
    try:
        fd = open_checked(RING, os.O_RDWR, directory=False, dir_fd=dfd)
        if fd is None:
            return None
        try:
            mm = map_apart(dfd, RING, fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dfd)
    return SegmentFile(fd, mm, os.path.join(path, RING))


def creation_abandoned(path: str) -> bool:
    """The private directory ``path`` holds no ring but an unfinished ``ring.tmp*`` that no one
    holds locked: its creator failed (or died) while making it."""
    try:
        dfd = open_checked(path, os.O_RDONLY, directory=True)
    except ShmSecurityError:
        return False  # not ours: the attach itself refuses it by name
    if dfd is None:
        return False
    try:
        names = os.listdir(dfd)
        if RING in names:
            return False
        for name in names:
            if name.startswith(RING + ".tmp"):
                fd = open_checked(name, os.O_RDONLY, directory=False, dir_fd=dfd)
                if fd is not None:
                    try:
                        return not lock_holder(fd, OWNER_LOCK)
                    finally:
                        os.close(fd)
        return False
    finally:
        os.close(dfd)


def remove_segment(path: str) -> None:
    """Unlink the ring and remove its private directory (the mappings stay valid). Touches nothing
    that fails the checks, so a path another user planted is left to its owner."""
    _empty(path)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass


def _empty(path: str) -> None:
    """Unlink the ring files of the private directory ``path`` (if it is this user's own)."""
    try:
        dfd = open_checked(path, os.O_RDONLY, directory=True)
    except ShmSecurityError:
        return
    if dfd is None:
        return
    try:
        for name in os.listdir(dfd):
            if name == RING or name.startswith((RING + ".tmp", RING + ".new")):
                os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def abandon_segment(path: str) -> None:
    """Mark the segment of a first rank that failed or died for the node's other ranks, and free
    its memory: the directory is renamed to ``path + ABANDONED``, where a rank still waiting for the
    segment finds it (:func:`was_abandoned`) instead of waiting for its timeout, and emptied; the
    empty marker goes at this user's next start (an empty directory, after its grace)."""
    try:
        os.rename(path, path + ABANDONED)
    except FileNotFoundError:
        pass  # another rank marked it already, or it never existed
    _empty(path + ABANDONED)


def was_abandoned(path: str) -> bool:
    """A rank of this job marked the segment at ``path`` as its first rank's failure."""
    try:
        dfd = open_checked(path + ABANDONED, os.O_RDONLY, directory=True)
    except ShmSecurityError:
        return False  # not ours: the attach itself refuses what sits at the real name
    if dfd is None:
        return False
    os.close(dfd)
    return True


def space_message(shm_dir: str, needed: int, available: int) -> str:
    """Why ``needed`` bytes do not fit in ``shm_dir``, and what to change."""
    st = os.statvfs(shm_dir)
    if st.f_files and not st.f_favail:  # tmpfs counts inodes (nr_inodes): bytes may be left, names not
        return (
            f"the shared-memory data loader needs 2 inodes in {shm_dir} (a directory and its ring) but all "
            f"{st.f_files} are in use: remove leftovers there (this user's stale mdsp-* entries go at the "
            "next start; others' need their owner), remount it with a larger nr_inodes, or point "
            "shm_data_loader.shm_dir at another tmpfs"
        )
    return (
        f"the shared-memory data loader needs {needed} bytes in {shm_dir} but only {available} bytes are free: "
        "lower shm_data_loader.slots or the micro-batch size, point shm_data_loader.shm_dir at a larger tmpfs, "
        "or enlarge /dev/shm (e.g. docker --shm-size)"
    )
