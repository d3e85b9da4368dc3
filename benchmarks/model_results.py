"""Rows of the model benchmark (benchmarks/bench_model.py) as data: read from its JSON
(``bench_model.py --json PATH``) or parsed from the Markdown tables it appends to
benchmarks/RESULTS.md, for plots (notebooks/gpu_speed.ipynb).

A row is {"gpu", "table", "m", "fmt", "ratio", "bf16_ms", "loop_ratio", "bf16_loop_ms"}: the
wall-time ratio of one decoder step in bf16 to the same step with ``fmt`` weights (> 1:
faster than bf16) at M tokens per step, each step blocked on, and bf16's step time; the
same in a decode loop (None in tables from before bench_model measured one), on ``gpu``
(the device named by the table's heading), ``table`` the heading itself.
"""
from __future__ import annotations

import json
import pathlib
import re
from typing import List

RESULTS = pathlib.Path(__file__).resolve().parent / "RESULTS.md"
_GPU = re.compile(r"\b(GB?\d{3}|H\d{3}|A\d{3}|L40S|L4|RTX \w+)\b")
_RATIO = re.compile(r"\*\*([0-9.]+)x(?: / ([0-9.]+)x)?\*\*")  # blocked[ / decode loop]
_MS = re.compile(r"^([0-9.]+)(?: / ([0-9.]+))? ms")


def _gpu(heading: str) -> str:
    m = _GPU.search(heading)
    return m.group(1) if m else heading


def parse_markdown(text: str) -> List[dict]:
    """Rows of every bench_model table in ``text``: a table whose header starts ``| M |``
    under a ``##`` or ``###`` heading naming bench_model.py. Cells without a bold
    ``**r.rrx**`` (or ``**r.rrx / l.llx**``) ratio (``-``: not measured) give no row."""
    rows, h2, h3, header = [], "", "", None
    for line in text.splitlines():
        if line.startswith("## "):
            h2, h3, header = line[3:].strip(), "", None
        elif line.startswith("### "):
            h3, header = line[4:].strip(), None
        elif line.startswith("| M |") and "bench_model" in h2 + h3:
            header = [c.strip() for c in line.strip().strip("|").split("|")]
        elif header and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not cells[0].isdigit():
                continue  # the |---| separator
            m = int(cells[0])
            bf16 = _MS.match(cells[1])
            for name, cell in zip(header[2:], cells[2:]):
                r = _RATIO.search(cell)
                if r:
                    loop = r.group(2) and bf16 and bf16.group(2)
                    rows.append(dict(gpu=_gpu(h3 or h2), table=h3 or h2, m=m, fmt=name,
                                     ratio=float(r.group(1)),
                                     bf16_ms=float(bf16.group(1)) if bf16 else None,
                                     loop_ratio=float(r.group(2)) if loop else None,
                                     bf16_loop_ms=float(bf16.group(2)) if loop else None))
        else:
            header = None if not line.startswith("|") else header
    return rows


def load(path=RESULTS) -> List[dict]:
    """Rows from a bench_model JSON file (a list of rows) or a Markdown file."""
    path = pathlib.Path(path)
    if path.suffix == ".json":
        return json.loads(path.read_text())
    return parse_markdown(path.read_text())
