"""Which of hierarchical ZeRO's paths have run on which collective backend: the one source for the
planner's ``--allow-unverified`` and for the table in docs/hierarchical_zero.md (a test renders
it from here). A path that has not run on a backend is proposed there only when asked for."""

from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """The collective library a job's hops run on."""

    GLOO = "gloo"
    NCCL = "nccl"
    RCCL = "rccl"

    @classmethod
    def of_profile(cls, collectives: str) -> Backend:
        """The backend a probe profile's ``versions["collectives"]`` names ("NCCL 2.21.5", "gloo (...)")."""
        word = collectives.split()[0].lower() if collectives.strip() else ""
        try:
            return cls(word)
        except ValueError:
            raise ValueError(
                f"a profile measured on the collective library {collectives!r}: this plugin knows "
                f"{', '.join(b.value for b in cls)}"
            ) from None


class Path(StrEnum):
    """A way the variant runs its hops, as the planner varies it."""

    LIBRARY_HOPS = "hops as library collectives, one level after another (the default)"
    RECURSIVE = "`recursive` (`batch_isend_irecv` steps)"
    PIPELINED = "`pipeline_chunks` > 1 (a thread per group on CPU, a stream per group on CUDA)"
    QUANTIZED = "quantized hops, boundary sync"
    PROBE = "the probe and the A/B command"


NEVER = "never"
RUN: dict[Path, dict[Backend, str]] = {
    Path.LIBRARY_HOPS: {
        Backend.GLOO: "tests, emulated cluster",
        Backend.NCCL: "one GPU only (`tests/gpu/test_main_job_cuda.py`, world size 1: no hop crosses a link)",
        Backend.RCCL: NEVER,
    },
    Path.RECURSIVE: {Backend.GLOO: "tests, emulated cluster", Backend.NCCL: NEVER, Backend.RCCL: NEVER},
    Path.PIPELINED: {
        Backend.GLOO: "tests, emulated cluster",
        Backend.NCCL: "never (`tests/gpu/test_hop_streams_cuda.py`, stream ordering on one GPU, is written and has not run)",
        Backend.RCCL: NEVER,
    },
    Path.QUANTIZED: {Backend.GLOO: "tests, emulated cluster", Backend.NCCL: NEVER, Backend.RCCL: NEVER},
    Path.PROBE: {Backend.GLOO: "tests, emulated cluster", Backend.NCCL: NEVER, Backend.RCCL: NEVER},
}
"""Where each path has run, per backend, in words, starting with ``never`` where it has not. A run
on one GPU checks ordering, not a hop across a link: it does not count as run."""


def has_run(path: Path, backend: Backend) -> bool:
    """Whether ``path`` has carried a hop across a link on ``backend``: the planner's test for a
    setting it may propose without ``--allow-unverified``."""
    where = RUN[path][backend]
    return not where.startswith(NEVER) and "one GPU" not in where
