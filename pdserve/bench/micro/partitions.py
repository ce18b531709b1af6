"""Partitions on hosts: how long after each network fault is healed the cluster is whole
again, and what the streams running through the fault got.

Each process runs on a host of its own (``pdserve.bench.hosts``): etcd, a router
(``--placement round_robin --disagg always``: every prompt's KV crosses a link), one
prefill and two decode workers (real vLLM, ``--etcd-ttl-s``, ``--kv-stall-s``,
``--lease-s``) and the client (this process's main thread, inside its host). Per fault
and repetition, ``--streams`` greedy streams of one fresh prompt (random tokens, so
nothing is cached) run at once while the fault hits:

- ``router-decode``: router and decode-0 cut both ways at the first stream's
  ``--cut-after-tokens``-th token (its streams move to decode-1);
- ``prefill-decode``: prefill's link at ``--pull-link-gbit``, then prefill cut from
  both decode workers at the first token, while they pull (decode recomputes);
- ``prefill-router``: prefill's packets to the router dropped, one way, before the
  streams are sent (the router cannot reach it: decode computes the prompts);
- ``worker-etcd``: prefill cut from etcd both ways (its lease lapses, it leaves the view)
  until the streams end and it has left;
- ``router-etcd``: the router cut from etcd both ways (it serves on its last view) for
  the streams and at least ``--etcd-ttl-s`` + 1 s;
- ``frozen-decode``: decode-0 SIGSTOPped at the ``--cut-after-tokens``-th token, SIGCONT
  once the streams ended (its streams move to decode-1).

Then everything is healed at once (the cuts undone, prefill's link back at
``--link-gbit``, the frozen worker continued), and the clock runs until the cluster is
**whole**: every worker registered in etcd and healthy in the router's view, the
router on etcd (``pdserve:membership_etcd_up`` 1), and each worker idle and holding no
KV lease (its own ``GetLoad``, from the client host), and still so a second later (the
time is when it first held). At most ``--whole-timeout-s``.
Last, the same prompt uninterrupted: each stream's tokens must equal it (``exact``).

It reports, per fault: heal -> whole p50 and max, the streams that ended with an answer,
those equal to the uninterrupted one, errors, and the slowest stream. Results:
``bench/results/partitions/`` (``results.json``, ``report.md``).

    sudo pdserve bench partitions --reps 3
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from pdserve.bench import hosts
from pdserve.bench.load.metrics import stats
from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.host_configs import PartitionsConfig
from pdserve.bench.micro.partitions_cluster import DECODES, Cluster
from pdserve.bench.workload.prompts import PromptEncoder
from pdserve.core.hardware import Hardware
from pdserve.core.model import DEFAULT_MODEL_NAME, cache_dir, prepare_default_model
from pdserve.core.tokenizer import load_tokenizer

POLL_S = 0.1
STABLE_S = 1.0  # whole means whole for this long
console = Console()


@dataclass
class Trial:
    """One fault, once."""

    fault: str
    rep: int
    heal_to_whole_s: float | None  # None: not whole within --whole-timeout-s
    answered: int  # streams that ended without an error, every token there
    exact: int  # ... equal to the uninterrupted answer
    errors: list[str]
    slowest_s: float
    # What moved during the trial (``Cluster.counts``), and worker-etcd's ``left_view_s``:
    # from the cut until the worker left the router's view.
    counts: dict[str, float]


def _inject(cluster: Cluster, fault: str, seen: dict[str, float]
            ) -> tuple[Callable[[], None], int, Callable[[], None]]:
    """The fault's act, the token it waits for (0: at once) and what it does once the
    streams ended (before the heal; what it saw goes into ``seen``)."""
    net, c = cluster.net, cluster.config
    cut_at: list[float] = []  # when a cut that lasts past the streams was made
    if fault == "router-decode":
        return lambda: net.cut("router", "decode-0", both=True), c.cut_after_tokens, _nothing
    if fault == "prefill-decode":
        def cut() -> None:
            for d in DECODES:
                net.cut("prefill-0", d, both=True)
        net.shape("prefill-0", c.pull_link_gbit)  # a long prompt's KV then takes seconds
        return cut, 1, _nothing
    if fault == "prefill-router":
        return lambda: net.cut("prefill-0", "router"), 0, _nothing
    if fault == "worker-etcd":
        def cut() -> None:
            net.cut("prefill-0", "etcd", both=True)
            cut_at.append(time.monotonic())

        def gone() -> None:  # it leaves the view once its lease lapsed
            if _wait(lambda: "prefill-0" not in cluster.healthy(), c.etcd_ttl_s + 30):
                seen["left_view_s"] = round(time.monotonic() - cut_at[0], 2)
        return cut, 0, gone
    if fault == "router-etcd":
        def cut() -> None:
            net.cut("router", "etcd", both=True)
            cut_at.append(time.monotonic())

        def held() -> None:  # the router's lease-less view outlives a worker TTL
            time.sleep(max(0.0, cut_at[0] + c.etcd_ttl_s + 1 - time.monotonic()))
        return cut, 0, held
    if fault == "frozen-decode":
        return lambda: cluster.signal("decode-0", signal.SIGSTOP), c.cut_after_tokens, _nothing
    raise ValueError(f"unknown fault {fault!r}")


def _nothing() -> None:
    return None


def _wait(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``predicate()`` held (polled every POLL_S), None if it did not."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(POLL_S)
    return None


def _wait_whole(cluster: Cluster, timeout_s: float) -> float | None:
    """Seconds until the cluster was whole and stayed whole for STABLE_S (a view that
    has not yet seen a worker's lease lapse reads whole for a moment), None if not
    within ``timeout_s``."""
    start = time.monotonic()
    since: float | None = None
    while time.monotonic() - start < timeout_s + STABLE_S:
        if not cluster.whole():
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= STABLE_S:
            return since - start if since - start <= timeout_s else None
        time.sleep(POLL_S)
    return None


def _heal(cluster: Cluster) -> None:
    cluster.net.heal()
    cluster.net.shape("prefill-0", cluster.config.link_gbit)
    cluster.signal("decode-0", signal.SIGCONT)


def trial(cluster: Cluster, fault: str, rep: int, prompt: list[int]) -> Trial:
    c = cluster.config
    body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": c.output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    before, seen = cluster.counts(), dict[str, float]()
    act, after, before_heal = _inject(cluster, fault, seen)
    try:
        out = cluster.streams(body, act, after)
        before_heal()
    finally:
        _heal(cluster)
    whole = _wait_whole(cluster, c.whole_timeout_s)  # its clock starts at the heal
    moved = {k: v - before[k] for k, v in cluster.counts().items()
             if k in before and v != before[k]}
    moved.update(seen)
    want = cluster.stream(body, lambda _: None)
    answered = [s for s in out if not s.error and len(s.ids) == c.output_tokens]
    return Trial(fault, rep, None if whole is None else round(whole, 2), len(answered),
                 sum(s.ids == want.ids for s in answered) if not want.error else 0,
                 [s.error for s in out if s.error] + ([f"reference: {want.error}"]
                                                      if want.error else []),
                 round(max(s.seconds for s in out), 2), moved)


def summary(trials: list[Trial], config: PartitionsConfig) -> list[dict[str, Any]]:
    rows = []
    for fault in config.fault_list:
        mine = [t for t in trials if t.fault == fault]
        if not mine:
            continue
        times = [t.heal_to_whole_s for t in mine if t.heal_to_whole_s is not None]
        moved: dict[str, float] = {}
        for t in mine:
            for k, v in t.counts.items():  # counts add up, times (``_s``): the longest
                moved[k] = max(moved.get(k, 0.0), v) if k.endswith("_s") else (
                    moved.get(k, 0.0) + v)
        rows.append({"fault": fault, "reps": len(mine), "whole": len(times),
                     "heal_to_whole_s": {**stats(times), "max": max(times, default=None)},
                     "counts": moved,
                     "streams": len(mine) * config.streams,
                     "answered": sum(t.answered for t in mine),
                     "exact": sum(t.exact for t in mine),
                     "errors": [e for t in mine for e in t.errors][:5],
                     "slowest_stream_s": max(t.slowest_s for t in mine)})
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(rows: list[dict[str, Any]], config: PartitionsConfig) -> str:
    lines = ["# Partitions on hosts (`pdserve bench partitions`)", "",
             f"{config.streams} streams per fault and repetition, {config.reps} "
             f"repetitions, prompts of {config.prompt_tokens} random tokens, "
             f"{config.output_tokens} greedy tokens, dtype {config.dtype}; links "
             f"{config.link_gbit:g} Gbit/s (prefill's at {config.pull_link_gbit:g} for "
             f"prefill-decode); --etcd-ttl-s {config.etcd_ttl_s}, --kv-stall-s "
             f"{config.kv_stall_s}, --lease-s {config.lease_s}. Whole: every worker "
             "registered and healthy in the router's view, the router on etcd, each "
             f"worker idle with no KV lease, and so for {STABLE_S:g} s on end.", "",
             "| fault | heal -> whole p50 s | max s | whole | streams answered | exact | "
             "slowest stream s | what moved | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["heal_to_whole_s"]
        lines.append(f"| {r['fault']} | {_s(t.get('p50'))} | {_s(t.get('max'))} | "
                     f"{r['whole']}/{r['reps']} | {r['answered']}/{r['streams']} | "
                     f"{r['exact']}/{r['streams']} | {r['slowest_stream_s']:.1f} | "
                     + (", ".join(f"{k} {v:g}" for k, v in sorted(r["counts"].items()))
                        or "-")
                     + f" | {'; '.join(r['errors']) or '-'} |")
    return "\n".join(lines) + "\n"


def run(config: PartitionsConfig) -> int:
    if why := hosts.prepare_process():
        console.print(f"[red]partitions needs hosts: {why}[/red]")
        return 2
    out = RESULTS_DIR / "partitions"
    log_dir = Path(config.log_dir) if config.log_dir else cache_dir() / "bench-partitions"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    vocab = PromptEncoder(load_tokenizer(prepare_default_model()), "completions").vocab
    rng = random.Random(config.seed)
    trials: list[Trial] = []
    machine = Hardware.detect().describe()
    with hosts.HostNet() as net:
        cluster = Cluster(net, config, log_dir)
        with hosts.inside(net.hosts["client"].netns):  # this thread, and those it starts
            try:
                cluster.start()
                for rep in range(config.reps):
                    for fault in config.fault_list:
                        prompt = [rng.choice(vocab) for _ in range(config.prompt_tokens)]
                        t = trial(cluster, fault, rep, prompt)
                        trials.append(t)
                        console.print(f"{fault} #{rep}: heal -> whole "
                                      f"{_s(t.heal_to_whole_s)} s, answered {t.answered}, "
                                      f"exact {t.exact}, slowest {t.slowest_s} s, "
                                      f"moved {t.counts}"
                                      + (f", errors {t.errors}" if t.errors else ""))
                        _write(out, config, machine, trials)  # a later crash keeps these
            finally:
                cluster.stop()
    rows = _write(out, config, machine, trials)
    console.print(report(rows, config))
    return 0 if all(r["whole"] == r["reps"] for r in rows) else 1


def _write(out: Path, config: PartitionsConfig, machine: str, trials: list[Trial]
           ) -> list[dict[str, Any]]:
    """``results.json`` and ``report.md`` of the trials so far; their rows."""
    rows = summary(trials, config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"config": asdict(config), "machine": machine, "rows": rows,
         "trials": [asdict(t) for t in trials]}, indent=1))
    (out / "report.md").write_text(report(rows, config).replace(
        "\n\n", f"\n\nMachine: {machine}.\n\n", 1))
    return rows
