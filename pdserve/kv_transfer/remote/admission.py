"""What is worth writing to the cluster KV store (``--kv-store-admission``), on the
connector's scheduler side, decided by the tiers' own policy interface (``tiers.policy``)
and made by their registry (``make_admission``).

The store uses two of the policy's calls:

- ``admit`` for each block a finished request would publish (one the store is not
  known to hold): a want. The request publishes its blocks up to the first one refused,
  never after it: a load takes only the contiguous run of a prompt's leading blocks, so
  a block after a hole would be written for nothing. Every block is still asked (each
  is a want), so a prefix wanted twice is admitted whole at its second request, not one
  block per request.
- ``record_access`` for each block a lookup found: a prefix read often stays admitted
  (the store's server may evict it; it is then written again at its next want).

The policy's window is ``WINDOW_BLOCKS`` (its sketch's width: a fixed memory, whatever
the traffic); keys are the blocks' store names' digests, which cover the whole identity
(model, weights, tenant, format) and the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.kv_transfer.remote.names import BlockName
from pdserve.kv_transfer.tiers.policies.admission import admitted_run
from pdserve.kv_transfer.tiers.policies.registry import make_admission
from pdserve.kv_transfer.tiers.policy import Key, TierPolicy

WINDOW_BLOCKS = 65_536  # the admission policy's capacity: a doorkeeper's sketch width


def policy_key(name: BlockName) -> Key:
    """``name``'s digest as the policy's key (its first 8 bytes are uniform)."""
    return bytes.fromhex(name.key.rpartition("}")[2])


class StoreAdmission:
    def __init__(self, policy: TierPolicy) -> None:
        self.policy = policy

    @classmethod
    def named(cls, spec: str) -> StoreAdmission | None:
        """``spec``'s admission (None: ``all``, every block is written)."""
        policy = make_admission(spec, WINDOW_BLOCKS)
        return None if policy is None else cls(policy)

    def run(self, names: Sequence[BlockName], tenant: str | None,
            now: float | None = None) -> int:
        """How many of ``names`` (a request's blocks to publish, in order) are written:
        those before the first the policy refuses. Every one is asked."""
        now = time.monotonic() if now is None else now
        return admitted_run(self.policy, [policy_key(n) for n in names], now, tenant)

    def found(self, names: Sequence[BlockName], now: float | None = None) -> None:
        """A lookup found ``names``: each is an access."""
        now = time.monotonic() if now is None else now
        for name in names:
            self.policy.record_access(policy_key(name), now)
