"""Release/acquire ordering for the ring's words, per machine architecture.

A writer fills a payload and then stores the 8-byte word that announces it; a reader loads the word
and then the payload. Python has no memory-order primitives, so the ring calls
:meth:`Fences.release` before each such store and :meth:`Fences.acquire` after each such load: free
on x86-64 (total store order), libatomic's ``atomic_thread_fence`` through ctypes on aarch64 (no
compiler needed on the nodes). Other architectures are refused. Why this is enough, and how to check
a node (``python -m megatron_ext.data.litmus``): docs/shm_data_loader.md, "Platforms".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import platform
from typing import Protocol

from mdsp_base.section import ConfigError


class Architecture(enum.StrEnum):
    """The machine architectures the ring runs on, and how it orders its words there."""

    X86_64 = "x86_64"
    """Total store order: plain stores and loads are already ordered."""
    AARCH64 = "aarch64"
    """Weakly ordered: release/acquire fences from libatomic."""


# platform.machine() spellings of each supported architecture (Linux, macOS, Windows)
_MACHINES = {
    "x86_64": Architecture.X86_64,
    "AMD64": Architecture.X86_64,
    "aarch64": Architecture.AARCH64,
    "arm64": Architecture.AARCH64,
}
_MEMORY_ORDER_ACQUIRE, _MEMORY_ORDER_RELEASE = 2, 3  # C11's memory_order values


class UnsupportedPlatformError(ConfigError):
    """The ring cannot order its words on this machine."""


class Fences(Protocol):
    """The two barriers the ring needs around its state words."""

    def release(self) -> None:
        """Every load and store before this call is visible before any store after it."""

    def acquire(self) -> None:
        """No load or store after this call happens before the loads preceding it."""


class TotalStoreOrder:
    """x86-64: program order is memory order for the ring's plain stores and loads; nothing to issue."""

    def release(self) -> None:
        return None

    def acquire(self) -> None:
        return None


class LibatomicFences:
    """C11 thread fences from the system's libatomic, called through ctypes."""

    def __init__(self, library: str | None = None) -> None:
        name = library or ctypes.util.find_library("atomic") or "libatomic.so.1"
        try:
            lib = ctypes.CDLL(name)
            fence = lib.atomic_thread_fence
        except (OSError, AttributeError) as e:
            raise UnsupportedPlatformError(
                f"the shared-memory data loader orders its ring with libatomic's atomic_thread_fence on "
                f"{platform.machine()}, and it could not be loaded ({name}: {e}): install GCC's runtime "
                "library (libatomic1 on Debian/Ubuntu, libatomic on RHEL/SUSE), or set "
                "shm_data_loader.enabled=false (drop --shm-data-loader) to use Megatron's loader"
            ) from None
        fence.argtypes = [ctypes.c_int]
        fence.restype = None
        self._fence = fence

    def release(self) -> None:
        self._fence(_MEMORY_ORDER_RELEASE)

    def acquire(self) -> None:
        self._fence(_MEMORY_ORDER_ACQUIRE)


def architecture(machine: str | None = None) -> Architecture:
    """The architecture of ``machine`` (default: this one); refuses an unsupported one by name."""
    machine = platform.machine() if machine is None else machine
    arch = _MACHINES.get(machine)
    if arch is None:
        raise UnsupportedPlatformError(
            f"the shared-memory data loader runs on {', '.join(a.value for a in Architecture)}, and this "
            f"machine is {machine!r}: its ring hands batches between processes through shared-memory "
            "words whose ordering has been worked out (and tested) only for x86-64's total store order and "
            "aarch64's release/acquire fences. Set shm_data_loader.enabled=false (drop --shm-data-loader) "
            "to use Megatron's loader on this machine"
        )
    return arch


def fences_for(machine: str | None = None) -> Fences:
    """The fences the ring uses on ``machine`` (default: this one); refuses what it cannot order."""
    return _fences(architecture(machine))


@functools.cache
def _fences(arch: Architecture) -> Fences:
    return TotalStoreOrder() if arch is Architecture.X86_64 else LibatomicFences()
