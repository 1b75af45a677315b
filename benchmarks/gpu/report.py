"""Where the GPU benchmarks leave their results: ``<out>/<name>.json`` and ``<out>/<name>.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path, name: str, payload: dict[str, Any], markdown: str) -> None:
    """Write the raw figures and the markdown table, and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{name}.md").write_text(markdown)
    print(markdown, flush=True)
