"""Fixtures shared by the router's unit tests."""

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from unit.dispatch_cluster import Cluster, running_cluster
from unit.fakes import default_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's real tokenizer, loaded once per session."""
    return default_tokenizer()


@pytest_asyncio.fixture(loop_scope="function")
async def cluster() -> AsyncIterator[Cluster]:
    """One fake prefill and one fake decode worker, both healthy in the pool; checks
    for leaks (work on a worker, assigned requests, pending tasks) at the end."""
    async with running_cluster() as c:
        yield c
