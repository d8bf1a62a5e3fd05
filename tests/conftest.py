"""Fixtures shared by the test files; the plain functions they use live in helpers.py (the workers import it too)."""

from __future__ import annotations

from typing import Iterator

import pytest

from helpers import Opened


@pytest.fixture
def opened() -> Iterator[Opened]:
    """``opened(config)`` opens a Checkpointer that is closed at teardown, whatever the test did.

    A file whose tests provoke a FlushError that closing raises again overrides this with ``Opened((FlushError,))``.
    """
    o = Opened()
    try:
        yield o
    finally:
        o.close()
