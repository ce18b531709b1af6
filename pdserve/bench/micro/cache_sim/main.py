"""``pdserve bench cache-sim``: every (policy, capacity) of ``--policy`` and
``--capacity-blocks`` on ``--trace``, one JSON line each (``infinite`` once)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.bench.micro.cache_sim.replay import replay
from pdserve.bench.micro.cache_sim.trace import load_trace
from pdserve.bench.micro.configs import CacheSimConfig


def run(config: CacheSimConfig) -> int:
    try:
        trace = load_trace(config.trace)
    except (OSError, ValueError) as exc:
        print(f"pdserve bench cache-sim: error: {exc}", file=sys.stderr)
        return 2
    lines = []
    for spec in config.policy:
        for capacity in config.capacity_blocks if spec != "infinite" else (0,):
            line = json.dumps(replay(trace, spec, capacity, config.admission).as_dict())
            print(line, flush=True)
            lines.append(line)
    if config.json:
        Path(config.json).write_text("".join(f"{line}\n" for line in lines))
    return 0
