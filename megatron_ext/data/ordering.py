"""Release/acquire ordering for the ring's words, per machine architecture.

The ring hands data between processes through 8-byte words in shared memory: a writer fills a
payload (a batch, a message, a pid's start time) and then stores the word that says it is there; a
reader loads the word and then reads the payload. That is correct only if the payload's stores
become visible no later than the word's store (*release*) and the reader's payload loads happen no
earlier than its load of the word (*acquire*). Python has no memory-order primitives, so the ring
calls :meth:`Fences.release` before each such store and :meth:`Fences.acquire` after each such load.

- **x86-64** keeps stores in program order and loads in program order (total store order): both
  fences are free, nothing is called.
- **aarch64** (Grace, Graviton, Ampere) reorders both: the fences are C11's
  ``atomic_thread_fence(memory_order_release / memory_order_acquire)`` from the system's libatomic
  (GCC's runtime, present wherever GCC-built software runs: ``libatomic1`` on Debian/Ubuntu,
  ``libatomic`` on RHEL), called through ctypes. A ctypes call is an opaque function call, so
  neither the interpreter's C compiler nor the CPU moves the surrounding stores or loads across it.
  libatomic's out-of-line fence does not look at its order argument: both calls issue a full
  barrier (``dmb ish``), stronger than release or acquire need, and as correct. No compiler is
  needed at install time, which a tiny extension module would require on every node image; a call
  costs about a microsecond, and the ring makes two or three per step and rank. Whether this
  machine reorders, and whether the fences stop it, is what ``python -m megatron_ext.data.litmus``
  shows on the node itself; the suite's stress tests run on x86-64, where a missing fence cannot
  show, so they are no evidence for aarch64.
- Each word is written with one aligned 8-byte store, which both architectures make single-copy
  atomic. Other architectures (POWER, RISC-V, ...) are refused: nobody has run the ring there.
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
