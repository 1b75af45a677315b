"""Files and directories no other local user can slip in: the loader's opens and their checks.

The ring lives in ``/dev/shm``, which every local user may write to. Every open here uses
``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` (no symlink is followed, a FIFO or device never blocks,
nothing leaks into exec'd children) and is followed by an ``fstat`` of what was opened: a private
directory must be a directory of this user with mode 0700, a ring file a regular file of this user
with mode 0600 and one link. Anything else raises :class:`ShmSecurityError`, naming the path and
what is wrong with it, instead of hanging the job or feeding it another user's data.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

# Never follow a symlink, never block on a FIFO or device, never leak into exec'd children.
SAFE_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ShmSecurityError(RuntimeError):
    """A loader file or directory is not what this user made: another user's, a symlink, a FIFO."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return str(uid)


def current_user() -> str:
    return user_name(os.geteuid())


_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "of unknown type")


def problem_with(st: os.stat_result, directory: bool) -> str | None:
    """Why ``st`` is not a private directory (0700) or ring file (0600, one link) of this user."""
    want_kind, want_mode = ("a directory", 0o700) if directory else ("a regular file", 0o600)
    if _kind(st.st_mode) != want_kind:
        return f"it is {_kind(st.st_mode)}, not {want_kind}"
    if st.st_uid != os.geteuid():
        return (
            f"it is owned by uid {st.st_uid} ({user_name(st.st_uid)}), not by uid {os.geteuid()} "
            f"({current_user()}) that runs this job"
        )
    if stat.S_IMODE(st.st_mode) != want_mode:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {want_mode:04o}"
    if not directory and st.st_nlink != 1:
        return f"it has {st.st_nlink} hard links, not 1"
    return None


def refusal(path: str, problem: str) -> ShmSecurityError:
    return ShmSecurityError(
        f"refusing {path} as a shared-memory data loader segment: {problem}. Only this job's ranks create "
        "it, so another local user or a foreign process may have planted it (to hang the job or feed it "
        "forged batches): remove it (as its owner or root) and find out who made it"
    )


def open_checked(path: str, flags: int, directory: bool, dir_fd: int | None = None) -> int | None:
    """Open without following symlinks or blocking, then check what was opened; None when absent."""
    try:
        fd = os.open(path, flags | SAFE_OPEN | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
            raise
        try:  # say what it is instead of the bare errno
            kind = _kind(os.lstat(path, dir_fd=dir_fd).st_mode)
            raise refusal(
                _shown(path, dir_fd), f"it is {kind}, not {'a directory' if directory else 'a regular file'}"
            ) from None
        except FileNotFoundError:
            return None
    problem = problem_with(os.fstat(fd), directory)
    if problem:
        os.close(fd)
        raise refusal(_shown(path, dir_fd), problem)
    return fd


def _shown(path: str, dir_fd: int | None) -> str:
    """``path`` as a message names it: with its directory where /proc can tell it."""
    if dir_fd is None:
        return path
    try:
        return f"{os.readlink(f'/proc/self/fd/{dir_fd}')}/{path}"
    except OSError:  # no /proc in this container
        return path


def check_shm_dir(shm_dir: str) -> None:
    """The parent of the private directories: if others may write to it without the sticky bit,
    they could rename our directory away and slip theirs in."""
    try:
        st = os.stat(shm_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"shm_data_loader.shm_dir={shm_dir!r} is not a directory: point it at a tmpfs"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise FileNotFoundError(
            f"shm_data_loader.shm_dir={shm_dir!r} is not a directory: point it at a tmpfs"
        )
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (0, os.geteuid()) or (shared and not st.st_mode & stat.S_ISVTX):
        raise ShmSecurityError(
            f"shm_data_loader.shm_dir={shm_dir!r} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) lets "
            "other users replace the loader's files: use a directory owned by root or you that is not writable by "
            "others, or has the sticky bit like /dev/shm (mode 1777)"
        )
