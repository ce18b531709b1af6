"""The micro-benchmarks (``pdserve bench transfer``, ``ttft``, ``router-cost``, ...): each
measures one mechanism and starts what it needs. One module per bench, each a frozen
``<Name>Config`` and a ``run(config) -> int``; the flags are ``pdserve.cli.bench_micro``'s.
"""

from __future__ import annotations

from pathlib import Path

# Where the benches write their result files: the checkout's bench/results/ when run from
# a source tree (an editable install), else ./bench/results under the working directory.
_CHECKOUT = Path(__file__).resolve().parents[3]
RESULTS_DIR = (_CHECKOUT if (_CHECKOUT / "bench").is_dir() and (_CHECKOUT / "pyproject.toml")
               .is_file() else Path.cwd()) / "bench" / "results"
