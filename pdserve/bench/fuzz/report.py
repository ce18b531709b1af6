"""The fuzz run's table: one row per port, then inputs and outcomes per class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.bench.fuzz.kv_client import OUTCOMES
from pdserve.bench.fuzz.kv_driver import PortReport

LEGEND = """\
crashes: a server thread died or a handler failed unexpectedly, or the listener stopped
  answering; errors: inputs answered {"ok": false, "error": ...}; ok: answered ok (a
  mutation that is still a valid message); closed: the server closed with no answer
  (e.g. a frame cut short); hung: not closed in time; stall: the longest a stalled
  connection was held; threads: the server's connection threads before -> after;
  leases: leases stuck in transfer and pool serves never finished; blocks: KV blocks
  staged in the push inbox that no accepted push owns; liveness: a real pull and push
  (or status, for a remote port) after the fuzz."""


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def rows(reports: Sequence[PortReport]) -> list[list[str]]:
    out = [["port", "inputs", "crashes", "errors", "ok", "closed", "hung", "stall s",
            "threads", "leases", "blocks", "liveness"]]
    for r in reports:
        threads = r.leaks.threads
        out.append([
            r.label, str(r.inputs), str(len(r.crashes)), str(r.total("error")),
            str(r.total("ok")), str(r.total("closed")),
            str(r.total("hung") + r.total("refused")),
            "-" if r.stall_max_s is None else f"{r.stall_max_s:.1f}",
            "-" if threads is None else f"{threads[0]}->{threads[1]}",
            _cell(r.leaks.leases), _cell(r.leaks.blocks), r.liveness])
    return out


def class_rows(report: PortReport) -> list[list[str]]:
    out = [[f"{report.label}: class", "inputs", *OUTCOMES]]
    for cls, counts in sorted(report.outcomes.items()):
        out.append([cls, str(sum(counts.values())), *(str(counts[k]) for k in OUTCOMES)])
    return out


def table(data: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in data) for i in range(len(data[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))).rstrip() for row in data]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render(reports: Sequence[PortReport], details: bool = True) -> str:
    parts = [table(rows(reports))]
    if details:
        parts += [table(class_rows(r)) for r in reports]
    for r in reports:
        parts += [f"{r.label}: CRASH {c}" for c in r.crashes]
    parts.append(LEGEND)
    return "\n\n".join(parts)


def as_json(report: PortReport) -> dict[str, Any]:
    return {"port": report.label, "inputs": report.inputs, "crashes": report.crashes,
            "outcomes": {cls: dict(c) for cls, c in report.outcomes.items()},
            "leaked_leases": report.leaks.leases, "leaked_blocks": report.leaks.blocks,
            "threads": report.leaks.threads, "stall_max_s": report.stall_max_s,
            "liveness": report.liveness, "seconds": round(report.seconds, 1),
            "passed": report.passed}
