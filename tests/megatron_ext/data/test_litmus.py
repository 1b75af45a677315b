"""The litmus self-check users run on their node: it catches a broken hand-over on any machine, never
sees a reordering through the ring's own accesses here, and its verdict says what each outcome means
(x86-64 cannot reorder; on aarch64 a reordering without fences and none with them proves the fences
work, none either way proves nothing about the CPU; any reordering with the fences on fails)."""

import platform
import subprocess
import sys

import pytest

from megatron_ext.data.litmus import LitmusResult, Outcome, message_passing, verdict
from megatron_ext.data.ordering import Architecture, fences_for


def test_a_writer_that_announces_before_it_writes_is_caught():
    broken = message_passing(fences_for(), 0.5, 1024, fenced=True, payload_first=False)
    assert broken.visits > 0 and broken.reorderings > 0, broken


def test_the_rings_hand_over_is_never_seen_reordered_here():
    result = message_passing(fences_for(), 0.5, 1024, fenced=True)
    assert result.visits > 0 and result.reorderings == 0, result


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 report")
def test_the_command_reports_that_x86_64_cannot_reorder():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.data.litmus", "--seconds", "0.3"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fences on : " in proc.stdout and ", 0 reordered" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert (
        last.startswith("PASS: x86-64")
        and "(total store order): this CPU cannot reorder these accesses" in last
    )


def _runs(fenced: int, unfenced: int) -> tuple[LitmusResult, LitmusResult]:
    return LitmusResult(True, True, 10**6, fenced), LitmusResult(False, True, 10**6, unfenced)


def test_aarch64_reordering_without_fences_and_none_with_them_shows_the_fences_work():
    outcome, text = verdict(Architecture.AARCH64, *_runs(0, 12))
    assert (
        outcome is Outcome.PASS and "reordered 12 of 1000000 hand-overs without fences and none with" in text
    )


def test_aarch64_with_no_reordering_at_all_is_inconclusive_not_a_clean_bill():
    outcome, text = verdict(Architecture.AARCH64, *_runs(0, 0))
    assert outcome is Outcome.INCONCLUSIVE and "inconclusive about the CPU" in text


@pytest.mark.parametrize("arch", list(Architecture))
def test_a_reordering_with_the_fences_on_fails_on_any_machine(arch):
    outcome, text = verdict(arch, *_runs(3, 40))
    assert outcome is Outcome.FAIL and text.startswith("3 reorderings with the ring's fences on")
