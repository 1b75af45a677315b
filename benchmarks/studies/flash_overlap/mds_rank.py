"""One rank of the Megatron-DeepSpeed layer benchmark: the patched tree's ``pretrain_gpt.py`` through
``python -m megatron_ext.launch``, its printed per-iteration times returned as this rank's result.

    python -m benchmarks.studies.flash_overlap.mds_rank [--on-p2p] PATH/TO/pretrain_gpt.py [upstream flags...]

Method in full: benchmarks/results/methods.md, `benchmarks.studies.flash_overlap.mds_rank`.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys

from benchmarks.flash_overlap.same_transport import torch_on_p2p
from mdsp_base.shutdown import exit_without_teardown
from megatron_ext.integration import launch
from multirank import write_result

ITERATION_MS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|")


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy."""

    def __init__(self, out: io.TextIOBase) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def main() -> int:
    argv = sys.argv[1:]
    on_p2p = argv[:1] == ["--on-p2p"]
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee), torch_on_p2p() if on_p2p else contextlib.nullcontext():
        code = launch.main(argv[on_p2p:])
    if code == 0:
        found = ITERATION_MS.findall(tee.kept.getvalue())
        write_result({"iteration_ms": [(int(it), float(ms)) for it, ms in found]})
    return code


if __name__ == "__main__":
    exit_without_teardown(main())
