"""The API key table: which key belongs to which tenant, and each tenant's limits.

One entry per key (a line of ``--api-key-file``, or one ``--api-key`` value), fields
separated by spaces, the key first::

    sk-alpha-1234567890 tenant=acme max_concurrent=8 tokens_per_s=2000 burst=20000
    sk-alpha-0987654321 tenant=acme      # a second key of acme: its limits are acme's
    sk-lone-key-5555555                  # a bare key, as before: a tenant of its own

- ``tenant=<name>``: 1 to 64 of ``A-Z a-z 0-9 _ . -``. Several keys may name one tenant;
  they share its limits and its counters. A key that names none is a tenant of its own,
  labelled ``key-<n>`` (its place among the configured keys, from 1: never the key, nor
  any part of it), so those names are reserved.
- Limits (a named tenant's; on any of its lines, once, or repeated identically):
  ``max_concurrent`` (requests at once), ``tokens_per_s`` (prompt + completion tokens,
  a token bucket refilled at that rate) and ``burst`` (the bucket's size; default one
  second's worth, ``DEFAULT_BURST_S``). ``limits.py`` enforces them.
- Blank lines and ``#`` comments are skipped, a ``#`` field ends the line.

Errors name where the entry was (``--api-key-file PATH line 3``) and never echo the key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import TypeVar

DEFAULT_BURST_S = 1.0  # the bucket holds this many seconds of tokens_per_s
MAX_TENANT_NAME = 64
_NAME = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_TENANT_NAME}}}")
_KEY_LABEL = re.compile(r"key-[0-9]+")  # the labels of unnamed keys' tenants
_FIELDS = ("tenant", "max_concurrent", "tokens_per_s", "burst")
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class TenantLimits:
    """None: no such limit."""

    max_concurrent: int | None = None
    tokens_per_s: float | None = None
    burst: float | None = None  # tokens; None: DEFAULT_BURST_S of tokens_per_s

    def __post_init__(self) -> None:
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError("max_concurrent must be an integer >= 1")
        for name in ("tokens_per_s", "burst"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0")
        if self.burst is not None and self.tokens_per_s is None:
            raise ValueError("burst needs tokens_per_s")

    def __bool__(self) -> bool:
        return self.max_concurrent is not None or self.tokens_per_s is not None

    @property
    def capacity(self) -> float:
        """The token bucket's size (only with ``tokens_per_s``)."""
        if self.burst is not None:
            return self.burst
        return (self.tokens_per_s or 0.0) * DEFAULT_BURST_S

    def share(self, share: float) -> TenantLimits:
        """The limits one of several router processes enforces (``--tenant-limits-share``):
        rates and burst times ``share``, ``max_concurrent`` rounded up (at least 1)."""
        if share == 1.0:
            return self
        return TenantLimits(
            None if self.max_concurrent is None else math.ceil(self.max_concurrent * share),
            None if self.tokens_per_s is None else self.tokens_per_s * share,
            None if self.burst is None else self.burst * share)

    def render(self) -> list[str]:
        return [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) is not None]


@dataclass(frozen=True)
class TenantSpec:
    """A named tenant: its keys (at least one) and its limits."""

    name: str
    keys: tuple[str, ...] = field(repr=False)
    limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        if not self.keys:
            raise ValueError(f"tenant {self.name} has no key")


@dataclass(frozen=True)
class KeyEntry:
    key: str = field(repr=False)
    tenant: str | None = None
    limits: TenantLimits = TenantLimits()


def check_tenant_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"a tenant name is 1 to {MAX_TENANT_NAME} of A-Z a-z 0-9 _ . -")
    if _KEY_LABEL.fullmatch(name):
        raise ValueError("tenant names key-<n> are reserved for keys without a tenant")
    return name


def key_label(index: int) -> str:
    """The tenant label of the unnamed key at ``index`` (from 0) among the keys."""
    return f"key-{index + 1}"


def check_api_key(key: str) -> str:
    """A key must survive an HTTP header and a comma-separated environment variable."""
    if not key.isascii() or not key.isprintable() or " " in key or "," in key or len(key) < 8:
        raise ValueError("an API key is at least 8 printable ASCII characters, no spaces or "
                         "commas")
    return key


def parse_key_entry(text: str) -> KeyEntry | None:
    """One entry; None for a blank line or a comment. A ValueError never echoes the key."""
    words = text.split()
    if not words or words[0].startswith("#"):
        return None
    key, found = words[0], dict[str, str]()
    if key.partition("=")[0] in _FIELDS:
        raise ValueError("the key comes first, then the name=value fields")
    check_api_key(key)
    for position, word in enumerate(words[1:], 2):
        if word.startswith("#"):
            break
        name, equals, value = word.partition("=")
        if not equals or name not in _FIELDS:
            raise ValueError(f"field {position} is not one of "
                             f"{', '.join(f + '=' for f in _FIELDS)}")
        if name in found:
            raise ValueError(f"{name} given twice")
        found[name] = value
    tenant = found.pop("tenant", None)
    limits = TenantLimits(_number(found, "max_concurrent", int, "an integer"),
                          _number(found, "tokens_per_s", float, "a number"),
                          _number(found, "burst", float, "a number"))
    if tenant is None and limits:
        raise ValueError("limits need tenant=<name>")
    return KeyEntry(key, None if tenant is None else check_tenant_name(tenant), limits)


def key_table(entries: Iterable[tuple[str, KeyEntry]]
              ) -> tuple[tuple[str, ...], tuple[TenantSpec, ...]]:
    """The keys (in order, each once) and the named tenants of ``(where, entry)`` pairs;
    ``where`` names the entry in errors. A key given twice must name the same tenant; a
    tenant's limits are given once, or again identically."""
    seen: dict[str, tuple[str, str | None]] = {}
    members: dict[str, list[str]] = {}
    limits: dict[str, tuple[str, TenantLimits]] = {}
    for where, entry in entries:
        try:
            _add(entry, where, seen, members, limits)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    tenants = tuple(TenantSpec(name, tuple(keys),
                               limits.get(name, ("", TenantLimits()))[1])
                    for name, keys in members.items())
    return tuple(seen), tenants


def _add(entry: KeyEntry, where: str, seen: dict[str, tuple[str, str | None]],
         members: dict[str, list[str]], limits: dict[str, tuple[str, TenantLimits]]) -> None:
    before = seen.get(entry.key)
    if before is not None and before[1] != entry.tenant:
        raise ValueError(f"its key is also {before[0]}'s, under another tenant")
    if before is None:
        seen[entry.key] = (where, entry.tenant)
        if entry.tenant is not None:
            members.setdefault(entry.tenant, []).append(entry.key)
    if entry.tenant is None or not entry.limits:
        return
    given = limits.setdefault(entry.tenant, (where, entry.limits))
    if given[1] != entry.limits:
        raise ValueError(f"tenant {entry.tenant}'s limits differ from those of {given[0]} "
                         "(give them once)")


def render_key_table(keys: Iterable[str], tenants: Iterable[TenantSpec]) -> list[str]:
    """Entries that ``key_table`` reads back as ``keys`` and ``tenants`` (a tenant's
    limits on its first key's entry)."""
    of: dict[str, TenantSpec] = {k: t for t in tenants for k in t.keys}
    entries = []
    for key in keys:
        tenant = of.get(key)
        if tenant is None:
            entries.append(key)
            continue
        limits = tenant.limits.render() if key == tenant.keys[0] else []
        entries.append(" ".join([key, f"tenant={tenant.name}", *limits]))
    return entries


def _number(found: dict[str, str], name: str, parse: Callable[[str], N], what: str
            ) -> N | None:
    """``name``'s value parsed, None if absent; ``ValueError`` saying it must be ``what``."""
    text = found.get(name)
    try:
        return None if text is None else parse(text)
    except ValueError:
        raise ValueError(f"{name} must be {what}") from None
