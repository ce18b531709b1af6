"""The micro-benchmarks (``pdserve bench transfer``, ``ttft``, ``router-cost``, ...): each
measures one mechanism and starts what it needs. One module per bench, each a frozen
``<Name>Config`` and a ``run(config) -> int``; the flags are ``pdserve.cli.bench_tools``'s.
"""

from __future__ import annotations

from pathlib import Path

# Where the benches write their result files: the checkout's bench/results/ (git-ignored).
RESULTS_DIR = Path(__file__).resolve().parents[3] / "bench" / "results"
