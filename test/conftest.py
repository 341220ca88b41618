"""pytest fixtures: implementation x store kind."""

from __future__ import annotations

import os

# torch's TCPStore reverse-resolves the address of every connection (on the server's event
# loop too). Where the resolver drops such queries, each lookup stalls for glibc's default
# 5 s x 2 attempts and eats the deadlines of timing tests. glibc reads RES_OPTIONS when a
# thread first resolves, so setting it here, before any store exists, caps every lookup of
# this process (the TCPStore servers' threads included) at 1 s; processes the tests start
# (torchrun nodes, spawned ranks) inherit it. A value already set is kept.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import pytest  # noqa: E402 - after RES_OPTIONS, before anything that could resolve a name
from helpers import IMPLS, STORE_KINDS, Stores  # noqa: E402


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=STORE_KINDS)
def stores(request: pytest.FixtureRequest) -> Stores:
    return Stores(request.param)


@pytest.fixture
def tcp() -> Stores:
    return Stores("tcp")
