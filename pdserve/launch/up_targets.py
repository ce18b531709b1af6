"""``pdserve up``'s Prometheus scrape targets: the router's ``/metrics`` and each
worker's (``--metrics-port``), printed as one line and written as file_sd JSON so a
local Prometheus can scrape the cluster (``file_sd_configs: [{files: [PATH]}]``)."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.core.files import write_atomic
from pdserve.launch.up_children import Child

# ``Child.extra`` key: host:port of the child's /metrics ("router", "prefill-0", ...);
# a child of several processes, each its own (comma-separated: "router-0", "router-1").
METRICS_KEY = "metrics"


def scrape_targets(children: list[Child]) -> dict[str, str]:
    """Target name -> host:port of its /metrics, router first."""
    ordered = sorted(children, key=lambda c: c.name != "router")
    targets: dict[str, str] = {}
    for child in ordered:
        endpoints = [e for e in child.extra.get(METRICS_KEY, "").split(",") if e]
        if len(endpoints) == 1:
            targets[child.name] = endpoints[0]
        for i, endpoint in enumerate(endpoints if len(endpoints) > 1 else ()):
            targets[f"{child.name}-{i}"] = endpoint
    return targets


def targets_line(targets: dict[str, str]) -> str:
    """``metrics: router=http://h:p/metrics prefill-0=http://...``: one line, not
    starting with ``http://`` (the first such line of up's output is its endpoint)."""
    return "metrics: " + " ".join(f"{name}=http://{hp}/metrics"
                                  for name, hp in targets.items())


def file_sd(targets: dict[str, str]) -> list[dict[str, object]]:
    """One target group per component; ``component`` is ``router`` or the worker's role,
    ``instance_name`` up's name for it (workers label their series with ``role`` too)."""
    return [{"targets": [hp], "labels": {"component": name.rsplit("-", 1)[0],
                                         "instance_name": name}}
            for name, hp in targets.items()]


def write_file_sd(path: Path, targets: dict[str, str]) -> Path:
    """Write atomically (Prometheus re-reads the file when it changes), through a fresh
    temporary file beside it (``mkstemp``: the folder may be a shared one such as
    ``/tmp``, where a fixed name could be a link another user planted), readable by
    all (Prometheus may run as another user: the file names endpoints, no secret)."""
    write_atomic(path, json.dumps(file_sd(targets), indent=2) + "\n", mode=0o644)
    return path
