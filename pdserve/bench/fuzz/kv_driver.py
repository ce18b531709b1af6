"""Run a number of fuzz inputs against one KV port and report what happened.

Inputs are drawn from a seed, class by class (``kv_inputs.CLASSES``, the ``slow`` and
``stall`` ones capped: each holds a server thread for the lease wait or the idle
deadline), in batches run ``concurrency`` at a time; the slow and stalled ones run
beside them from the start. After each batch the port must still answer a fresh
``status`` (else the listener stopped accepting: a crash). At the end, once every
connection is over, the target says what is still held, and a real transfer runs.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.bench.fuzz import kv_inputs
from pdserve.bench.fuzz.kv_client import Outcome, Peer, send_input
from pdserve.bench.fuzz.kv_inputs import KvInput, KvSurface
from pdserve.bench.fuzz.kv_watch import Leaks
from pdserve.kv_transfer.control.channel import LEASE_WAIT_S

BATCH = 500
ANSWER_S = 10.0  # a server answers and closes within this after the client's half-close
SLACK_S = 3.0  # past a stalled connection's deadline, before it counts as held
SIDE_THREADS = 64  # slow and stalled inputs, run beside the batches


class KvTarget(Protocol):
    """A fuzzed port: ``peer`` (how to reach it), ``stall_deadline_s`` (how long it
    may hold a connection that stalls), ``surface`` (what a batch's inputs may name),
    ``after_batch`` (the transfers pushed in it, taken as a decode would), ``crashes``
    (seen so far), ``alive`` (a fresh status works), ``settle`` (once every input is
    over: what is still held), ``liveness`` (a real transfer), ``close``."""

    label: str
    peer: Peer
    stall_deadline_s: float

    def surface(self, batch: int) -> KvSurface: ...

    def after_batch(self, staged: Sequence[str]) -> None: ...

    def crashes(self) -> list[str]: ...

    def alive(self) -> bool: ...

    def settle(self, staged: Sequence[str], timeout_s: float) -> Leaks: ...

    def liveness(self) -> str: ...

    def close(self) -> None: ...


@dataclass
class PortReport:
    label: str
    inputs: int = 0
    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    crashes: list[str] = field(default_factory=list)
    leaks: Leaks = field(default_factory=lambda: Leaks(None, None, None))
    stall_max_s: float | None = None
    liveness: str = "not run"
    seconds: float = 0.0

    def total(self, kind: str) -> int:
        return sum(c[kind] for c in self.outcomes.values())

    @property
    def passed(self) -> bool:
        return (not self.crashes and self.total("hung") == 0 and self.total("refused") == 0
                and self.leaks.total == 0 and self.liveness.endswith("ok"))


def plan(num_inputs: int, classes: dict[str, int], rng: random.Random,
         max_stalls: int | None = None) -> list[str]:
    """The class of every input, shuffled: ``slow`` at most 1 % (64 at most), ``stall``
    0.5 % (48 at most, or ``max_stalls``), the rest by the classes' weights."""
    caps = {"slow": min(64, num_inputs // 100),
            "stall": min(48, max(1, num_inputs // 200)) if max_stalls is None else max_stalls}
    counts = {c: min(caps[c], num_inputs) for c in caps if classes.get(c)}
    rest = num_inputs - sum(counts.values())
    weights = {c: w for c, w in classes.items() if c not in caps and w}
    scale = sum(weights.values())
    for c, w in weights.items():
        counts[c] = rest * w // scale
    counts[max(weights, key=lambda c: weights[c])] += num_inputs - sum(counts.values())
    labels = [c for c, n in counts.items() for _ in range(n)]
    rng.shuffle(labels)
    return labels


def fuzz_port(target: KvTarget, num_inputs: int, seed: int = 0, concurrency: int = 16,
              max_stalls: int | None = None) -> PortReport:
    started = time.monotonic()
    rng = random.Random(seed)
    classes = kv_inputs.SECRET_CLASSES if target.peer.secret else kv_inputs.CLASSES
    labels = plan(num_inputs, classes, rng, max_stalls)
    report = PortReport(target.label, inputs=len(labels))
    staged: list[str] = []
    side: list[tuple[KvInput, Future[Outcome]]] = []
    stall_limit = target.stall_deadline_s + SLACK_S
    with ThreadPoolExecutor(concurrency) as pool, ThreadPoolExecutor(SIDE_THREADS) as aside:
        for start in range(0, len(labels), BATCH):
            surface = target.surface(start // BATCH)
            items = [kv_inputs.make(rng, cls, surface, start + i)
                     for i, cls in enumerate(labels[start:start + BATCH])]
            for item in items:
                if item.slow:
                    side.append((item, aside.submit(send_input, target.peer, item,
                                                    ANSWER_S + LEASE_WAIT_S, stall_limit)))
            now = [i for i in items if not i.slow]
            for item, outcome in zip(now, pool.map(
                    lambda i: send_input(target.peer, i, ANSWER_S, stall_limit), now),
                    strict=True):
                report.outcomes[item.cls][outcome.kind] += 1
            batch_staged = [i.xfer for i in now if i.may_stage and i.xfer is not None]
            target.after_batch(batch_staged)
            if not target.alive():
                report.crashes.append(f"listener stopped answering after input {start + BATCH}")
                break
        for item, future in side:
            outcome = future.result()
            report.outcomes[item.cls][outcome.kind] += 1
            if item.cls == "stall":
                report.stall_max_s = max(report.stall_max_s or 0.0, outcome.seconds)
            if item.may_stage and item.xfer is not None:
                staged.append(item.xfer)
    report.leaks = target.settle(staged, stall_limit)
    report.crashes += target.crashes()
    report.liveness = target.liveness() if target.alive() else "FAILED: port not answering"
    report.seconds = time.monotonic() - started
    return report
