"""Leader election: which one of the router replicas runs the cluster's single planner.

The contract (``Election``) and its static implementation; the etcd one is
``etcd_election.py``. A router that is not a candidate (``--planner off``) never leads.

etcd layout: key ``/pdserve/<cluster>/planner/leader`` holds the leader's ``candidate_id``
under the leader's own lease; it exists while, and only while, someone leads.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.membership.base import check_name


def leader_key(cluster: str) -> str:
    return f"/pdserve/{check_name('cluster', cluster)}/planner/leader"


class Election(Protocol):
    """A candidate's view of one leadership.

    Ownership: the leadership is a key under a lease that this candidate created; only
    this candidate keeps it alive or revokes it, and nobody else writes the key while it
    exists (the others campaign only for an absent key).

    ``start()`` begins campaigning in the background and returns once a first attempt
    ended (won, lost, or failed and left to retry); it never raises for a store outage.
    ``close()`` stops campaigning and resigns: the lease is revoked at once (best
    effort, bounded), so another candidate takes over without waiting out the TTL.

    ``is_leader`` is true only while this candidate holds the key *and* its lease is
    known alive: it turns false by itself once the last keepalive that etcd confirmed
    is older than the TTL (less a margin), so a leader cut off from etcd, or paused,
    stops leading before etcd could let another candidate win. A lost lease or a
    deleted key ends the leadership at once; the candidate then campaigns again.
    Every call to the store has a deadline. ``describe()`` is a JSON-able status for
    ``/workers``.
    """

    name: str
    candidate_id: str

    @property
    def is_leader(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, object]: ...


class StaticElection:
    """No store to agree in: this process leads iff it is a candidate. With static
    membership that is the router started with ``--planner on`` (one machine, one
    router); it is also what a non-candidate runs, whatever the membership."""

    name = "static"

    def __init__(self, candidate: bool, candidate_id: str = "") -> None:
        self.candidate = candidate
        self.candidate_id = candidate_id

    @property
    def is_leader(self) -> bool:
        return self.candidate

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"kind": self.name, "candidate": self.candidate, "leader": self.is_leader}
