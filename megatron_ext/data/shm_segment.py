"""The node's shared-memory file: its name, its owner, the space it needs, and stale leftovers.

Segments are plain files in a tmpfs (``/dev/shm``) opened with ``os.open`` and mapped with
``mmap``: ``multiprocessing.shared_memory`` would register them with Python's resource tracker,
which may unlink a live segment when an unrelated process that attached exits. A segment is
created mode 0600 under a temporary name, sized with ``posix_fallocate`` (a full tmpfs then gives
ENOSPC at once, not a SIGBUS at first touch) and renamed into place once its header is written,
so a reader never sees a half-made file. The name carries the user and the job; the owner's pid
and start time sit in the header so that a later run can tell a dead job's leftover from a live one.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import mmap
import os
import pwd
import re
import struct

from deepspeed_ext.config import ConfigError

PREFIX = "mdsp"
MAGIC = 0x4D44535052494E47  # "MDSPRING": marks a header this module wrote
OWNER_FIELDS = struct.Struct("qqq")  # magic, owner pid, owner start time: the first words of every header


class ShmSpaceError(ConfigError):
    """The ring does not fit in the shared-memory directory; the message gives both sizes."""


def current_user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return str(os.geteuid())


def resolve_job_id(explicit: str | None = None) -> str:
    """An id that every rank of one run computes alike and two concurrent runs do not share:
    ``explicit``, else Slurm's job (and step) id, else a hash of the rendezvous variables."""
    if explicit:
        raw = explicit
    elif os.environ.get("SLURM_JOB_ID"):
        raw = os.environ["SLURM_JOB_ID"] + "." + os.environ.get("SLURM_STEP_ID", "0")
    else:
        keys = [os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")]
        if not keys[1] and not keys[2]:
            keys.append(str(os.getppid()))  # file rendezvous: the ranks share their launcher
        raw = hashlib.sha1("|".join(keys).encode()).hexdigest()[:12]
    return re.sub(r"[^A-Za-z0-9_.]", "_", raw)


def segment_path(shm_dir: str, job_id: str, node: int) -> str:
    return os.path.join(shm_dir, f"{PREFIX}-{current_user()}-{job_id}-node{node}")


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when it is gone or a zombie.
    Pid plus start time names a process unambiguously, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def is_alive(pid: int, start_time: int) -> bool:
    return pid > 0 and process_start_time(pid) == start_time


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged writer may still allocate in ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def remove_stale_segments(shm_dir: str) -> list[str]:
    """Unlink this user's segments whose owner process is gone (a killed job); returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(shm_dir, f"{PREFIX}-{current_user()}-*")):
        tmp = re.search(r"\.tmp(\d+)$", path)
        if tmp:  # a creation that never finished: only its creator's pid is known
            dead = process_start_time(int(tmp.group(1))) is None
        else:
            dead = _owner_is_dead(path)
        if dead:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def _owner_is_dead(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(OWNER_FIELDS.size)
    except OSError:
        return False  # not ours to judge (permissions) or already gone
    if len(head) < OWNER_FIELDS.size:
        return False
    magic, pid, start = OWNER_FIELDS.unpack(head)
    return magic == MAGIC and not is_alive(pid, start)


def create_segment(path: str, size: int, header: bytes) -> mmap.mmap:
    """Create ``path`` (mode 0600) of ``size`` bytes starting with ``header``, mapped read-write.
    The space is checked and reserved before anything is written."""
    if os.path.exists(path):
        raise FileExistsError(
            f"{path} belongs to a live process: another run with the same job id on this node? "
            "pass a distinct job id"
        )
    shm_dir = os.path.dirname(path)
    available = free_bytes(shm_dir)
    if size > available:
        raise ShmSpaceError(_space_message(shm_dir, size, available))
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise ShmSpaceError(_space_message(shm_dir, size, free_bytes(shm_dir))) from None
            raise
        mm = mmap.mmap(fd, size)
        mm[: len(header)] = header
        os.rename(tmp, path)
        return mm
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor


def open_segment(path: str) -> mmap.mmap | None:
    """Map an existing segment read-write; None when it does not exist (yet)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _space_message(shm_dir: str, needed: int, available: int) -> str:
    return (
        f"the shared-memory data loader needs {needed} bytes in {shm_dir} but only {available} bytes are free: "
        "lower shm_data_loader.slots or the micro-batch size, point shm_data_loader.shm_dir at a larger tmpfs, "
        "or enlarge /dev/shm (e.g. docker --shm-size)"
    )
