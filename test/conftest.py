"""pytest fixtures: implementation x store kind."""

from __future__ import annotations

import pytest
from helpers import IMPLS, STORE_KINDS, Stores


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=STORE_KINDS)
def stores(request: pytest.FixtureRequest) -> Stores:
    return Stores(request.param)


@pytest.fixture
def tcp() -> Stores:
    return Stores("tcp")
