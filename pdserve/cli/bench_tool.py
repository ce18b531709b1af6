"""How ``pdserve bench <tool>`` declares a micro-benchmark (``Tool``: its module, config
and flags), the flags that mean the same in every tool that takes them (``shared``) and
the value parsers the tools share; ``bench_micro.py`` holds the table. A tool's flags are
declared as every flag is (``flag_types.py``: each reads its ``PDSERVE_<FLAG>``
variable); their defaults are the tool's config's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pdserve.cli.flag_types import Flag, parse_integer, parse_number

# Each tool's default is its own config's (a tool may add words to the help: ``shared``).
_SHARED = {flag.name: flag for flag in (
    Flag("reps", "measured repetitions (each after a warm-up)", parse=parse_integer),
    Flag("dtype", "the engines' dtype (auto: float32 on CPUs without native bf16)"),
    Flag("max-tokens", "output tokens per request", parse=parse_integer),
    Flag("port-base", "the first of the ports the bench's processes use",
         parse=parse_integer),
    Flag("json", "also write the numbers to this file"),
    Flag("seed", "random seed", parse=parse_integer),
    Flag("clients", "concurrent clients", parse=parse_integer),
    Flag("requests", "short requests", parse=parse_integer),
    Flag("long-requests", "long requests", parse=parse_integer),
    Flag("long-tokens", "output tokens of a long request", parse=parse_integer),
    Flag("duration-s", "seconds of load", parse=parse_number),
    Flag("deadline-s", "a request unanswered after this long counts as hung",
         parse=parse_number),
)}


def shared(name: str, **override: Any) -> Flag:
    """A flag that means the same in every tool that takes it (``override``: this
    tool's words, e.g. its own help)."""
    return replace(_SHARED[name], **override)


def csv_list(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """A comma-separated flag value, each part parsed by ``kind``."""
    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    return parse


@dataclass(frozen=True)
class Tool:
    module: str  # pdserve.bench.micro.<module>: run(config) -> int
    config: type
    help: str
    flags: tuple[Flag, ...]
