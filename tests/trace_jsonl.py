"""Writing a trace in specgov's generic JSONL format (a test helper: no source code
writes traces; ``load_trace`` reads this format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specgov.simulator.workload.traces import Trace


def write_trace_jsonl(trace: Trace, path: Path) -> None:
    """Write ``trace`` as generic JSONL: ``load_trace`` reads it back to equal requests
    (floats are written with ``repr`` precision); the name comes back as the file stem."""
    lines = []
    for r in trace.requests:
        rec: dict[str, Any] = {
            "arrival_s": r.arrival_s,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
        }
        if r.domain is not None:
            rec["domain"] = r.domain
        if r.acc_len is not None:
            rec["acc_len"] = list(r.acc_len)
        if r.hash_ids is not None:
            rec["hash_ids"] = list(r.hash_ids)
        lines.append(json.dumps(rec, separators=(",", ":")) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
