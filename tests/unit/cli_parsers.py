"""Every parser of the ``pdserve`` command line, by its command words, for the tests that
check them all (their help text, the flags the docs name)."""

from __future__ import annotations

import argparse

from pdserve.cli import bench as bench_cli
from pdserve.cli.parser import build_parser

Parsers = dict[tuple[str, ...], argparse.ArgumentParser]


def all_parsers() -> Parsers:
    """``()``: ``pdserve`` itself; ``("up",)``, ``("bench", "run")``,
    ``("bench", "disagg-proxy")``, ... ``pdserve bench``'s own parser (and its proxy's)
    stands in for the top-level parser's ``bench`` placeholder."""
    parsers: Parsers = {}
    _walk((), build_parser(), parsers)
    _walk(("bench",), bench_cli.build_parser(), parsers)
    parsers[("bench", bench_cli.PROXY)] = bench_cli.build_proxy_parser()
    return parsers


def _walk(words: tuple[str, ...], parser: argparse.ArgumentParser, out: Parsers) -> None:
    out[words] = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _walk((*words, name), sub, out)
