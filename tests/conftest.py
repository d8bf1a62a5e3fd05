"""Fixtures shared by the test files; the plain functions they use live in helpers.py (the workers import it too)."""

from __future__ import annotations

from typing import Iterator

import pytest

from helpers import Opened


@pytest.fixture
def opened(request: pytest.FixtureRequest) -> Iterator[Opened]:
    """``opened(config)`` opens a Checkpointer that is closed at teardown, whatever the test did.

    A test module whose tests provoke errors that closing raises again (asserted on by the test already)
    names them in ``CLOSE_TOLERATES``; anywhere else an error on closing fails the test.
    """
    o = Opened(tolerate=getattr(request.module, "CLOSE_TOLERATES", ()))
    try:
        yield o
    finally:
        o.close()
