"""The main job's iteration line is Megatron-LM's: every field that Megatron's ``training_log``
prints (core_v0.16.1, read from the tree in ../shared/upstream/) appears in the job's line in
Megatron's own format and order, with the values a hand count gives; a CPU run prints no TFLOP/s."""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.upstream import TARBALLS, UPSTREAM

TRAINING_PY = "Megatron-LM/megatron/training/training.py"
# The fields a Megatron log parser reads, in the order training_log prints them ("lm loss" is the
# loss key Megatron's pretrain_gpt.py reports, printed through training_log's ' {}: {:.6E} |').
FIELDS = [
    "iteration",
    "consumed samples",
    "elapsed time per iteration (ms)",
    "learning rate",
    "global batch size",
    "lm loss",
    "grad norm",
    "number of skipped iterations",
    "number of nan iterations",
]
PLACEHOLDER = re.compile(r"\{[^{}]*\}")


def _megatron_templates() -> dict[str, str]:
    """training_log's ``log_string += '...'`` pieces by field name, each as a ``str.format``
    template (an f-string's ``{name:spec}`` becomes ``{:spec}``)."""
    tarball = UPSTREAM / TARBALLS["megatron-lm"]
    if not tarball.is_file():
        pytest.skip(f"{tarball} is missing (the upstream tarballs beside the project)")
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(TRAINING_PY)
        assert member is not None
        source = member.read().decode()
    body = source[source.index("def training_log(") :]
    body = body[: body.index("\ndef ")]
    templates = {}
    for literal in re.findall(r"log_string \+= f?'([^']*)'", body):
        template = PLACEHOLDER.sub(_positional, literal)
        if template.startswith(" {}: "):  # the loss keys: ' {}: {:.6E} |'.format(key, avg)
            template = template.replace("{}", "lm loss", 1)
        templates[template.split("{")[0].strip().rstrip(":")] = template
    return templates


def _positional(placeholder: re.Match[str]) -> str:
    """An f-string's ``{expression:spec}`` as ``str.format``'s ``{:spec}``."""
    _, colon, spec = placeholder.group(0)[1:-1].partition(":")
    return "{" + colon + spec + "}"


def _parse(template: str, line: str) -> tuple[int, list[str]]:
    """Where ``template`` matches in ``line`` and the text of each placeholder; each text must be
    what the placeholder's own format makes of its value (Megatron's widths and precisions)."""
    specs = [m.group(0)[2:-1] for m in PLACEHOLDER.finditer(template)]
    pattern = "".join(
        re.escape(piece) + ("(.+?)" if i < len(specs) else "")
        for i, piece in enumerate(PLACEHOLDER.split(template))
    )
    match = re.search(pattern, line)
    assert match, f"Megatron's {template!r} not in the job's line:\n{line}"
    texts = list(match.groups())
    for spec, text in zip(specs, texts):
        value = int(text) if spec.endswith("d") else float(text)
        assert format(value, spec) == text, (template, text)
    return match.start(), texts


def test_the_templates_are_read_from_megatron() -> None:
    """The parse of Megatron's source finds every field (a change upstream fails here first)."""
    templates = _megatron_templates()
    assert set(FIELDS) <= set(templates), sorted(templates)
    assert templates["iteration"] == " iteration {:8d}/{:8d} |"
    assert templates["lm loss"] == " lm loss: {:.6E} |"


def test_the_job_prints_megatrons_iteration_line(
    pretrain_main: Callable[..., int], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    templates = _megatron_templates()
    log, ds = tmp_path / "log.jsonl", tmp_path / "ds.json"
    # ZeRO-1: DeepSpeed's optimizer reports the gradient norm (the engine's basic optimizer does not,
    # and the line then leaves it out, as Megatron's does for a None norm)
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    # one rank, micro batch 2 x 2 accumulation steps: 4 samples per iteration; constant learning rate
    flags = ("--train-iters", "3", "--global-batch-size", "4", "--min-lr", "3e-3", "--log-json", str(log))
    assert pretrain_main(*flags, "--deepspeed-config", str(ds)) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    records = [json.loads(r) for r in log.read_text().splitlines()]
    assert len(lines) == 3 and len(records) == 3, lines
    for it, (line, record) in enumerate(zip(lines, records), start=1):
        assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration ", line), line
        where = {}
        for field in FIELDS:
            where[field], texts = _parse(templates[field], line)
            expected = {
                "iteration": [f"{it:8d}", f"{3:8d}"],
                "consumed samples": [f"{4 * it:12d}"],
                "learning rate": ["3.000000E-03"],
                "global batch size": ["    4"],
                "number of skipped iterations": ["  0"],
                "number of nan iterations": ["  0"],
            }.get(field)
            if expected is not None:
                assert texts == expected, (field, texts, line)
        assert float(_parse(templates["lm loss"], line)[1][0]) == pytest.approx(record["loss"], rel=1e-6)
        assert list(where) == sorted(where, key=where.__getitem__), f"not in Megatron's order:\n{line}"
        # fp32 on the CPU: no loss scale; no model TFLOP/s without an accelerator
        assert "loss scale" not in line and "TFLOP/s" not in line and "tflops_per_gpu" not in record
