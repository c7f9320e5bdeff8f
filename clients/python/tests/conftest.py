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
def make_serve(tmp_path):
    """Starts ``shardq serve`` processes: ``make_serve(name, shards=4,
    args=(), data=None)`` over a fresh data dir ``name`` (or over ``data``,
    another's); every one is killed at the end."""
    made: List[Serve] = []

    def make(name: str, shards: int = 4, args=(), data=None, owned=None) -> Serve:
        if data is None:
            data = os.path.join(str(tmp_path), name, "q")
            os.makedirs(os.path.dirname(data), exist_ok=True)
            shardq("init", "--data", data, "--shards", str(shards))
        s = Serve(data, shards if owned is None else owned)
        s.args = list(args)
        made.append(s)
        s.start()
        return s

    yield make
    for s in made:
        if s.proc is not None and s.proc.poll() is None:
            s.stop(signal.SIGKILL)


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
