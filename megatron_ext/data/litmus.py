"""A message-passing litmus test of the ring's memory ordering, to run on the node that trains:

    python -m megatron_ext.data.litmus [--seconds 2] [--cells 4096]

Two processes run the ring's hand-over pattern over shared memory (payload, then the word that
announces it; ``ordering``'s fences), once with the fences on and once off, after a self-check that
shows the test can see a reordering. Exit status 1 when a reordering is seen with the fences on: the
loader must not run here. What each architecture shows: docs/shm_data_loader.md, "Platforms".
"""

from __future__ import annotations

import argparse
import dataclasses
import mmap
import os
import platform
import time
from enum import StrEnum

from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.data.ordering import Architecture, Fences, TotalStoreOrder, architecture, fences_for

_LINE_WORDS = 8  # 64-byte cache lines: a cell's data and flag never share one
_CELL_WORDS = 2 * _LINE_WORDS


@dataclasses.dataclass(frozen=True)
class LitmusResult:
    """One run of the message-passing test."""

    fenced: bool
    """The ring's fences were issued (else none)."""
    payload_first: bool
    """The writer stored the data before the flag (False: the self-check's broken hand-over)."""
    visits: int
    """Cells the reader checked after seeing a flag set."""
    reorderings: int
    """Visits whose data word was older than the flag word read before it."""


def message_passing(
    fences: Fences, seconds: float, cells: int, fenced: bool, payload_first: bool = True
) -> LitmusResult:
    """Run the writer in a forked child for about ``seconds`` while this process reads.
    ``payload_first=False`` swaps the writer's two stores (the self-check)."""
    first, second = (0, _LINE_WORDS) if payload_first else (_LINE_WORDS, 0)
    mm = mmap.mmap(-1, cells * _CELL_WORDS * 8)  # anonymous and shared: the child writes into it
    words = memoryview(mm).cast("q")
    deadline = time.monotonic() + seconds
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            round_ = 0
            while time.monotonic() < deadline:
                round_ += 1
                for cell in range(0, cells * _CELL_WORDS, _CELL_WORDS):
                    words[cell + first] = round_  # the payload (the flag in the self-check)
                    fences.release()
                    words[cell + second] = round_  # the word that announces it
            code = 0
        finally:
            os._exit(code)
    visits = reorderings = 0
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            for cell in range(0, cells * _CELL_WORDS, _CELL_WORDS):
                flag = words[cell + _LINE_WORDS]
                fences.acquire()
                data = words[cell]
                if flag:
                    visits += 1
                    reorderings += data < flag
    finally:
        words.release()
        mm.close()
    return LitmusResult(fenced, payload_first, visits, reorderings)


class Outcome(StrEnum):
    """The litmus test's last word."""

    PASS = "PASS"
    """The ring may run here: the CPU cannot reorder these accesses, or it did and the fences held."""
    FAIL = "FAIL"
    """The ring's fences let a reordering through: do not run the loader here."""
    INCONCLUSIVE = "INCONCLUSIVE"
    """No reordering either way on a CPU that may reorder: nothing against the ring, nothing shown."""


def verdict(arch: Architecture, fenced: LitmusResult, unfenced: LitmusResult) -> tuple[Outcome, str]:
    """What the two runs say about this machine: the outcome and why."""
    if fenced.reorderings:
        return (
            Outcome.FAIL,
            f"{fenced.reorderings} reorderings with the ring's fences on: the node loader's ring is not "
            "safe on this machine; set shm_data_loader.enabled=false and report the machine",
        )
    if arch is Architecture.X86_64:
        return (
            Outcome.PASS,
            "x86-64 keeps stores and loads in program order (total store order): this CPU cannot reorder these "
            f"accesses, fences or not ({unfenced.reorderings} seen without them)",
        )
    if unfenced.reorderings:
        return (
            Outcome.PASS,
            f"this CPU reordered {unfenced.reorderings} of {unfenced.visits} hand-overs without fences and none "
            "with the ring's fences: the fences are needed here, and they work",
        )
    return (
        Outcome.INCONCLUSIVE,
        "no reordering with the fences on; none caught with them off either, although this CPU may reorder: "
        "inconclusive about the CPU (run longer with --seconds), no evidence against the ring",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.data.litmus", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each of the two runs")
    parser.add_argument("--cells", type=int, default=4096, help="message cells the writer cycles through")
    args = parser.parse_args(argv)
    arch = architecture()
    broken = message_passing(fences_for(), min(args.seconds, 0.5), args.cells, True, payload_first=False)
    if not broken.reorderings:
        print(
            f"{Outcome.FAIL}: the self-check never caught a writer announcing before it writes "
            f"({broken.visits} checks): this test cannot see reorderings here"
        )
        return 1
    fenced = message_passing(fences_for(), args.seconds, args.cells, fenced=True)
    unfenced = message_passing(TotalStoreOrder(), args.seconds, args.cells, fenced=False)
    print(f"machine: {platform.machine()} ({arch.value}); ring fences: {type(fences_for()).__name__}")
    print(f"self-check: flag stored before data, {broken.reorderings} of {broken.visits} hand-overs caught")
    for result in (fenced, unfenced):
        label = "fences on " if result.fenced else "fences off"
        print(f"{label}: {result.visits} hand-overs checked, {result.reorderings} reordered")
    outcome, why = verdict(arch, fenced, unfenced)
    print(f"{outcome}: {why}")
    return 1 if outcome is Outcome.FAIL else 0


if __name__ == "__main__":
    exit_without_teardown(main())
