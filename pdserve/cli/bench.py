"""``pdserve bench``: ``run`` one workload against an endpoint, ``sweep`` it over rates or
concurrencies, ``compare`` systems, ``gaps`` (lone requests), and the micro-benchmarks
(``transfer``, ``ttft``, ``router-cost``, ... : ``bench_micro``). Each subcommand's flags
(``bench_flags``) become its frozen config, which ``pdserve.bench`` runs. Bad input, an
unreachable endpoint or an unknown model: one ``pdserve bench: error: ...`` line and exit
code 2, no result file.

``disagg-proxy`` (not listed) runs the proxy compare puts in front of vLLM's own P/D
engines when ``vllm-router`` is not installed (``pdserve.bench.compare.disagg_proxy``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.bench.compare import gaps
from pdserve.bench.compare import main as compare
from pdserve.bench.load import run, sweep
from pdserve.cli import bench_flags, bench_micro

DESCRIPTION = "Load-generator benchmarks against any OpenAI-compatible endpoint."
PROXY = "disagg-proxy"
# What only the bench extra installs and the commands that need it (compare's plots);
# without it they say how to get it.
BENCH_EXTRA_MODULES = frozenset({"matplotlib"})
BENCH_EXTRA_INSTALL = "pip install 'pdserve[bench]'"


def _run(args: argparse.Namespace) -> int:
    return run.main(bench_flags.run_config(args))


def _sweep(args: argparse.Namespace) -> int:
    return sweep.main(bench_flags.sweep_config(args))


def _compare(args: argparse.Namespace) -> int:
    write_report = compare.report_writer()  # first: without matplotlib, nothing starts
    return compare.main(bench_flags.compare_config(args), write_report)


def _gaps(args: argparse.Namespace) -> int:
    return gaps.main(bench_flags.gaps_config(args))


def _disagg_proxy(args: argparse.Namespace) -> int:
    from pdserve.bench.compare.disagg_proxy import serve

    serve(args.prefill, args.decode, args.port, args.host)
    return 0


def _add(sub: Any, name: str, add_flags: Callable[[argparse.ArgumentParser], None],
         func: Callable[[argparse.Namespace], int], **kwargs: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(name, **kwargs)
    add_flags(p)
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="subcommand", required=True)
    _add(sub, "run", bench_flags.add_run_flags, _run,
         help="drive an OpenAI-compatible endpoint with a seeded workload",
         description="Drive an OpenAI-compatible endpoint with a seeded workload (open loop "
         "at --request-rate, or closed loop at --max-concurrency) and report TTFT, TPOT, "
         "ITL, E2E, throughput and goodput as vllm bench serve defines them.")
    _add(sub, "sweep", bench_flags.add_sweep_flags, _sweep,
         help="run at several rates or concurrencies; the highest meeting the SLO",
         description="One workload at several rates (or concurrencies), and the highest "
         "one that meets the SLO.")
    _add(sub, "compare", bench_flags.add_compare_flags, _compare,
         help="aggregated vLLM vs pdserve (and vLLM's own P/D) on the same cores, "
         "same workload and rates; one report",
         description="Aggregated vLLM, optionally vLLM's own P/D, and pdserve configurations "
         "one after another on the same cores, the same seeded workload and rates against "
         "each; one report (report.json, report.md, PNG plots).",
         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add(sub, "gaps", bench_flags.add_gaps_flags, _gaps,
         help="lone short and long requests: each one's TTFT and largest token gap, "
         "aggregated vLLM vs pdserve",
         description="Lone requests (one at a time, idle system), short and long, against "
         "one aggregated vLLM and pdserve configurations on the same cores; per request "
         "TTFT, the largest gap between two tokens and the total. A gap >= --stall-s is a "
         "stall.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench_micro.add_tool_commands(sub)
    return parser


def build_proxy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"pdserve bench {PROXY}", description="The proxy in front of vLLM's own "
        "disaggregated serving (the vllm-disagg system of compare).")
    bench_flags.add_disagg_proxy_flags(parser)
    parser.set_defaults(func=_disagg_proxy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [PROXY]:  # not listed: compare's, not a user's
        args = build_proxy_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    if getattr(args, "tool", None):  # a micro-benchmark: its own errors, its tracebacks
        return bench_micro.run_tool(args)
    try:
        return int(args.func(args))
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in BENCH_EXTRA_MODULES:
            raise
        print(f"pdserve bench: error: {exc.name} is not installed; {BENCH_EXTRA_INSTALL}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench: interrupted; no result written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
