"""Shared by the cluster KV store's tests: fresh block names and random blocks."""

from __future__ import annotations

import itertools
import os

from pdserve.kv_transfer.remote.names import BlockName, KVIdentity

IDENT = KVIdentity("fp0", "default", "bfloat16", "cpu", 16, (2, 16, 128))
_prompts = itertools.count(1)


def fresh_names(n: int, ident: KVIdentity = IDENT) -> list[BlockName]:
    """``n`` block names of a prompt no other test uses."""
    base = next(_prompts) << 16
    return ident.names([base + i for i in range(n)])


def random_blocks(n: int, size: int = 4096) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]
