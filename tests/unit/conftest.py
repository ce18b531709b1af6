"""Fixtures shared by the router's unit tests."""

from typing import Any

import pytest
from unit.fakes import default_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The default model's real tokenizer, loaded once per session."""
    return default_tokenizer()
