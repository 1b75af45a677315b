"""Where the node benchmark's corpus lives: a slowed filesystem (root), or the plain disk (fallback).

Method in full: benchmarks/results/methods.md, `benchmarks.data_loader.node_storage`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

BLKIO = "/sys/fs/cgroup/blkio"
DEFAULT_READAHEAD_KB = 128  # the kernel's VM_READAHEAD_PAGES on a 4 KiB-page machine


class StorageError(RuntimeError):
    """The slowed filesystem could not be set up; the message says which step failed and why."""


@dataclass
class Storage:
    prefix: str
    """The corpus the ranks read (``.bin`` / ``.idx``)."""
    label: str
    """How it is stored and slowed, for the report."""
    throttled: bool = False
    read_bps: int = 0
    readahead_kb: int = 0
    device: str = ""
    """``major:minor`` of the slowed device."""
    cgroup: str = ""
    _undo: list[list[str]] = field(default_factory=list)
    _paths: list[str] = field(default_factory=list)

    def enter(self) -> None:
        """Move the calling process into the throttled cgroup (a child's ``preexec_fn``)."""
        if self.cgroup:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def device_read(self) -> dict[str, int]:
        """Bytes and read requests the cgroup's processes have taken from the device so far."""
        out = {"bytes": 0, "ios": 0}
        if not self.cgroup:
            return out
        for name, key in (
            ("blkio.throttle.io_service_bytes", "bytes"),
            ("blkio.throttle.io_serviced", "ios"),
        ):
            with open(os.path.join(self.cgroup, name)) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                        out[key] = int(parts[2])
        return out

    def close(self) -> None:
        """Undo the set-up (unmount, detach, remove the cgroup and the image), last step first."""
        errors = []
        for cmd in reversed(self._undo):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        self._undo.clear()
        for path in reversed(self._paths):
            try:
                os.rmdir(path) if os.path.isdir(path) else os.remove(path)
            except OSError as e:
                errors.append(f"remove {path}: {e}")
        self._paths.clear()
        if errors:
            print("slowed filesystem clean-up: " + "; ".join(errors), flush=True)


def plain(prefix: str, why: str) -> Storage:
    fs = _filesystem(prefix + ".bin")
    return Storage(prefix=prefix, label=f"unthrottled ({why}): the corpus on {fs}, not slowed")


def _filesystem(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if os.path.abspath(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
                best, kind = mnt, f"{fstype} ({dev} at {mnt})"
    return kind


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise StorageError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()


def throttled(
    prefix: str, workdir: str, read_mib_s: float, readahead_kb: int = DEFAULT_READAHEAD_KB
) -> Storage:
    """A copy of the corpus ``prefix`` on a loop device whose reads the ranks' cgroup may take at
    ``read_mib_s`` MiB/s at most; raises :class:`StorageError` naming the step that failed."""
    if os.geteuid() != 0:
        raise StorageError("not root: a loop device, a mount and a blkio cgroup need root")
    if not os.path.isfile(os.path.join(BLKIO, "blkio.throttle.read_bps_device")):
        raise StorageError(f"no cgroup v1 blkio throttle at {BLKIO}")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise StorageError(f"`{tool}` is not installed")
    read_bps = int(read_mib_s * 2**20)
    name = os.path.basename(prefix)
    image, mount = os.path.join(workdir, "slowfs.img"), os.path.join(workdir, "slowfs")
    store = Storage(prefix=os.path.join(mount, name), label="", throttled=True, read_bps=read_bps)
    try:
        data = sum(os.path.getsize(prefix + ext) for ext in (".bin", ".idx"))
        with open(image, "wb") as f:
            f.truncate(data + data // 8 + 64 * 2**20)  # sparse; ext4's own metadata on top
        store._paths.append(image)
        _run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", image])
        loop = _run(["losetup", "--find", "--show", "--direct-io=on", image])
        store._undo.append(["losetup", "-d", loop])
        os.makedirs(mount, exist_ok=True)
        store._paths.insert(1, mount)  # removed after the image: last in, first out
        _run(["mount", "-o", "noatime", loop, mount])
        store._undo.append(["umount", mount])
        for ext in (".bin", ".idx"):
            shutil.copyfile(prefix + ext, store.prefix + ext)
        os.sync()
        _run(["mount", "-o", "remount,ro,noatime", mount])
        dev = os.stat(loop).st_rdev
        store.device = f"{os.major(dev)}:{os.minor(dev)}"
        with open(f"/sys/block/{os.path.basename(loop)}/queue/read_ahead_kb", "w") as f:
            f.write(str(readahead_kb))
        store.readahead_kb = readahead_kb
        store.cgroup = os.path.join(BLKIO, f"node-bench-{os.getpid()}")
        os.mkdir(store.cgroup)
        store._undo.append(["rmdir", store.cgroup])
        with open(os.path.join(store.cgroup, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{store.device} {read_bps}")
    except (OSError, StorageError) as e:
        store.close()
        raise StorageError(str(e)) from None
    store.label = (
        f"throttled: ext4 on a loop device ({loop}, direct I/O, read_ahead_kb {readahead_kb}), reads "
        f"limited to {read_mib_s:g} MiB/s for the ranks' processes (cgroup v1 "
        f"blkio.throttle.read_bps_device {store.device} {read_bps})"
    )
    return store
