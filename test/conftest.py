"""pytest fixtures: implementation x store kind."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# torch's TCPStore reverse-resolves the address of every connection (on the server's event
# loop too). Where the resolver drops such queries, each lookup stalls for glibc's default
# 5 s x 2 attempts and eats the deadlines of timing tests. glibc reads RES_OPTIONS when a
# thread first resolves, so setting it here, before any store exists, caps every lookup of
# this process (the TCPStore servers' threads included) at 1 s; processes the tests start
# (torchrun nodes, spawned ranks) inherit it. A value already set is kept.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

# Everything the tests leave on disk goes to one scratch directory, removed at exit: FileStore
# files (helpers.scratch), and whatever the processes they start write to their TMPDIR (torchrun
# makes a torchelastic_* log directory per agent and never removes it). This process keeps the
# system's temporary directory (pytest's tmp_path with it). Registered before torch_ctrl is
# imported, so it runs after torch_ctrl's exit hook has drained the watchers' cleanup, which
# still writes to FileStores.
tempfile.tempdir = tempfile.gettempdir()
_SCRATCH = tempfile.mkdtemp(prefix="torch_ctrl_tests_")
os.environ["TORCH_CTRL_TEST_SCRATCH"] = os.environ["TMPDIR"] = _SCRATCH
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)

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
