"""Fixtures shared by the client tests: stand-ins for ``shardq serve``
(``fakes``) and a real one over a fresh data dir (``serve``)."""

from __future__ import annotations

import os
import signal
import tempfile
from typing import List

import pytest

from fake_serve import FakeServe
from support import Serve, shardq


@pytest.fixture
def fakes():
    made: List[FakeServe] = []

    def make(name: str = "s", token=None) -> FakeServe:
        f = FakeServe(name, token)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


@pytest.fixture
def serve():
    tmp = tempfile.TemporaryDirectory(prefix="shardq-serve-e2e-")
    data = os.path.join(tmp.name, "q")
    shardq("init", "--data", data, "--shards", "4")
    s = Serve(data, 4)
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        s.stop(signal.SIGKILL)
    tmp.cleanup()
