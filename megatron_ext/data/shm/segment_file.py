"""A ring file as one process holds it: mapped, and locked where that process's life is announced.

Every process that uses a ring holds an open-file-description lock (``F_OFD_SETLK``) on a byte of the
ring file for its whole life (:class:`SegmentFile`); the kernel drops it when the process and any
child that inherited the descriptor are gone, and anyone with a descriptor asks whether a byte is
held (``F_OFD_GETLK``). Unlike a pid this holds across PID namespaces and survives pid reuse
(docs/shm_data_loader.md, "Containers"). The map has an open file description of its own
(:func:`map_apart`) and a forked producer closes the lock descriptors it inherited
(:meth:`SegmentFile.adopt`), so no lock outlives its holder.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os
import struct
import weakref

from megatron_ext.data.shm.private import SAFE_OPEN

OWNER_LOCK = 0  # the byte of the ring file its creator (the node's first rank) holds locked
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux (x86-64, aarch64): type, whence, start, len, pid


def lock_holder(fd: int, byte: int, length: int = 1) -> bool:
    """Another open file description holds a lock on ``length`` bytes from ``byte`` of ``fd``'s file
    (0: to its end). Asked as a read lock, so a descriptor opened read-only may ask too."""
    query = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, byte, length, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0] != fcntl.F_UNLCK


def take_lock(fd: int, byte: int) -> bool:
    """Lock ``byte`` of ``fd``'s file for ``fd``'s open file description; False when another holds it."""
    request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class SegmentFile:
    """A ring file mapped read-write, and the descriptor whose open file description holds this
    process's locks on it: they last until :meth:`close`, or until the process is gone."""

    def __init__(self, fd: int, mm: mmap.mmap, path: str | None = None) -> None:
        self.fd = fd
        self.mm = mm
        self.path = path
        """Where the file was opened (it may be unlinked since)."""
        _open_files.add(self)

    def adopt(self, fd: int) -> None:
        """In a forked child (the producer): close every segment descriptor inherited from the
        parent, whose locks must keep saying only whether the parent lives (a child holding the
        parent's descriptor of another loader's ring would keep the parent alive there), and hold
        this file through ``fd`` instead."""
        for inherited in list(_open_files):
            if inherited.fd >= 0:
                os.close(inherited.fd)
                inherited.fd = -1
        self.fd = fd

    def lock(self, byte: int) -> bool:
        """Hold ``byte`` for this process's life; False when another process holds it."""
        return take_lock(self.fd, byte)

    def held(self, byte: int) -> bool:
        """Another process holds ``byte``: the one that locked it is alive."""
        return lock_holder(self.fd, byte)

    def new_description(self) -> int:
        """A second open file description of the same file, opened by its name (before the name is
        removed), for a child whose locks must not be this process's: a forked child shares the
        parent's."""
        if self.path is None:
            raise ValueError("this segment file was opened without a path: it cannot be opened again")
        return _reopen(os.open, self.path, self.fd)

    def close(self) -> None:
        """Unmap (unless a view still pins the map: it is unmapped when that dies) and drop the locks."""
        fd, self.fd = self.fd, -1
        _open_files.discard(self)
        try:
            self.mm.close()
        except BufferError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)


# The segment files this process has open: a forked producer closes the descriptors it inherited.
_open_files: weakref.WeakSet[SegmentFile] = weakref.WeakSet()


def map_apart(dfd: int, name: str, fd: int, size: int) -> mmap.mmap:
    """Map ``fd``'s file (``name`` in the directory ``dfd``) read-write through an open file
    description of its own: ``mmap`` keeps a duplicate of the descriptor it maps, and a duplicate of
    the locking descriptor would share its locks, and keep them held in every forked child (the
    producer) after this process is gone."""
    map_fd = _reopen(functools.partial(os.open, dir_fd=dfd), name, fd)
    try:
        return mmap.mmap(map_fd, size)
    finally:
        os.close(map_fd)


def _reopen(opener, name: str, fd: int) -> int:
    """Open ``name`` again (read-write, no symlink followed), and check it is ``fd``'s file."""
    again = opener(name, os.O_RDWR | SAFE_OPEN)
    mine, theirs = os.fstat(fd), os.fstat(again)
    if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
        os.close(again)
        raise RuntimeError(
            f"{name} was replaced while this process had it open: the segment is not this job's alone"
        )
    return again
