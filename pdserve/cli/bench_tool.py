"""How ``pdserve bench <tool>`` declares a micro-benchmark (``Tool``: its module, config
and flags) and the flag value parsers the tools share; ``bench_micro.py`` holds the table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A flag: a shared one by name (``bench_micro.SHARED``), or (name, argparse keywords).
Flag = str | tuple[str, dict[str, Any]]


def csv_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma-separated flag value, each part parsed by ``kind``."""
    def parse(text: str) -> list[Any]:
        return [kind(part) for part in text.split(",") if part.strip()]
    return parse


@dataclass(frozen=True)
class Tool:
    module: str  # pdserve.bench.micro.<module>: run(config) -> int
    config: type
    help: str
    flags: tuple[Flag, ...]
