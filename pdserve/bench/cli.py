"""``pdserve bench``: ``run`` one workload against an endpoint, ``sweep`` it over rates or
concurrencies. Subcommands register from ``SUBCOMMANDS`` (each module has
``add_parser(subparsers)`` and ``main(args) -> int``). Bad input, an unreachable endpoint
or an unknown model: one ``pdserve bench: error: ...`` line and exit code 2, no result
file."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from pdserve.bench import compare, gaps, run, sweep

SUBCOMMANDS: list[ModuleType] = [run, sweep, compare, gaps]
DESCRIPTION = "Load-generator benchmarks against any OpenAI-compatible endpoint."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(sub).set_defaults(func=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench: interrupted; no result written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
