"""The KV tiers' policies by name (``--kv-tier-policy``): one registry, which refuses an
unknown name listing the valid ones.

- ``lru``: least recently used.
- ``wtinylfu``: W-TinyLFU, a 1 % LRU window and frequency admission into the rest.
- ``wtinylfu-climb``: W-TinyLFU whose window share tunes itself by hill climbing
  (Caffeine's scheme; measured behind ``default``).
- ``ttl`` / ``ttl:SECONDS``: LRU whose blocks expire that long after they were saved
  (default 3600).
- ``s3fifo``: S3-FIFO (a small FIFO, a main FIFO with a 2-bit CLOCK, a ghost of 4× the
  tier's keys: a block saved again while its key is a ghost goes to main).
- ``default``: LRU or S3-FIFO, whichever of two shadows of the tier has hit more lately
  (``adaptive.py``; measured on Mooncake's public traces: docs/benchmarks.md).
- ``quota:NAME``: NAME (any of the above) with per-tenant quotas; ``quota`` alone wraps
  ``default``.
- ``doorkeeper:NAME``: NAME's eviction behind TinyLFU's frequency doorkeeper (``admission.py``:
  a block is admitted at its second want within a window); ``doorkeeper`` alone wraps
  ``lru``.

The cluster KV store's admission (``--kv-store-admission``) is ``all`` (every block is
written) or any of these names: the store asks the policy only ``admit`` and tells it of
hits (``record_access``); only ``doorkeeper`` ever refuses.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.kv_transfer.tiers.policies.adaptive import DefaultPolicy
from pdserve.kv_transfer.tiers.policies.admission import Doorkeeper, Gated
from pdserve.kv_transfer.tiers.policies.lru import LruPolicy, TtlPolicy
from pdserve.kv_transfer.tiers.policies.quota import QuotaPolicy
from pdserve.kv_transfer.tiers.policies.s3fifo import S3FifoPolicy
from pdserve.kv_transfer.tiers.policies.tinylfu import AdaptiveTinyLfuPolicy, TinyLfuPolicy
from pdserve.kv_transfer.tiers.policy import TierPolicy

DEFAULT_POLICY = "default"
DEFAULT_TTL_S = 3600.0
ADMIT_ALL = "all"  # the store's admission: every block is written

Factory = Callable[[int, str], TierPolicy]  # (capacity in blocks, the ``:`` argument)


def _ttl(capacity: int, arg: str) -> TierPolicy:
    try:
        ttl_s = float(arg) if arg else DEFAULT_TTL_S
    except ValueError:
        raise ValueError(f"ttl:SECONDS needs a number of seconds, got {arg!r}") from None
    return TtlPolicy(ttl_s)


def _quota(capacity: int, arg: str) -> TierPolicy:
    if arg.startswith("quota"):
        raise ValueError("quota:quota is not a policy")
    return QuotaPolicy(make_policy(arg or DEFAULT_POLICY, capacity), capacity)


def _doorkeeper(capacity: int, arg: str) -> TierPolicy:
    if arg.startswith("doorkeeper"):
        raise ValueError("doorkeeper:doorkeeper is not a policy")
    return Gated(Doorkeeper(capacity), make_policy(arg or "lru", capacity))


POLICIES: dict[str, Factory] = {
    "lru": lambda capacity, arg: LruPolicy(),
    "wtinylfu": lambda capacity, arg: TinyLfuPolicy(capacity),
    "s3fifo": lambda capacity, arg: S3FifoPolicy(capacity),
    "ttl": _ttl,
    "default": lambda capacity, arg: DefaultPolicy(capacity),
    "wtinylfu-climb": lambda capacity, arg: AdaptiveTinyLfuPolicy(capacity),
    "quota": _quota,
    "doorkeeper": _doorkeeper,
}
_TAKES_ARG = ("ttl", "quota", "doorkeeper")


def policy_names() -> tuple[str, ...]:
    return tuple(POLICIES)


def make_policy(spec: str, capacity: int) -> TierPolicy:
    """The policy ``spec`` names (``NAME`` or ``NAME:ARG``) for a tier of ``capacity``
    blocks; ``ValueError`` naming the valid ones for an unknown name."""
    name, _, arg = spec.partition(":")
    factory = POLICIES.get(name)
    if factory is None or (arg and name not in _TAKES_ARG):
        raise ValueError(f"unknown KV tier policy {spec!r}; valid policies: "
                         f"{', '.join(POLICIES)} (also ttl:SECONDS, quota:NAME, "
                         "doorkeeper:NAME)")
    if capacity <= 0:
        raise ValueError(f"a KV tier policy needs capacity > 0 blocks, got {capacity}")
    return factory(capacity, arg)


def check_policy(spec: str) -> str:
    """``spec`` if it names a policy (a flag's parser); ``ValueError`` if not."""
    make_policy(spec, 1)
    return spec


def admission_names() -> tuple[str, ...]:
    return (ADMIT_ALL, *POLICIES)


def make_admission(spec: str, capacity: int) -> TierPolicy | None:
    """The store's admission policy ``spec`` names for a window of ``capacity`` blocks
    (None: ``all``, every block written); ``ValueError`` naming the valid ones."""
    if spec == ADMIT_ALL:
        return None
    if spec.partition(":")[0] not in POLICIES:
        raise ValueError(f"unknown KV store admission {spec!r}; valid: "
                         f"{', '.join(admission_names())} (and NAME:ARG as a tier policy)")
    return make_policy(spec, capacity)


def check_admission(spec: str) -> str:
    """``spec`` if it names a store admission (a flag's parser); ``ValueError`` if not."""
    make_admission(spec, 1)
    return spec
