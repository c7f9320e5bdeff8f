"""``shardq.pg.enqueue`` with psycopg 3 against a real PostgreSQL (initdb
into a temporary directory, a free loopback port; run as the ``postgres``
user when the tests run as root) and the real ``shardq pg`` commands: a
rolled-back transaction leaves no job, a committed one gives exactly one,
each payload form arrives as given, bad input is refused in the caller's
transaction."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from typing import Iterator, Tuple

import pytest

import psycopg  # noqa: E402  (psycopg 3: .ci/run installs it)

import shardq.pg  # noqa: E402

from support import free_port, wait_until  # noqa: E402
from support import shardq as cli  # noqa: E402


def _bin_dir() -> str:
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    for d in reversed(dirs):
        if os.path.exists(os.path.join(d, "postgres")):
            return d
    found = shutil.which("postgres")
    assert found, "PostgreSQL's initdb and postgres are needed (Debian's postgresql package)"
    return os.path.dirname(found)


@pytest.fixture
def pg() -> Iterator[str]:
    root = tempfile.mkdtemp(prefix="shardq-pg-py-")
    as_pg = {}
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_pg = {"user": user.pw_uid, "group": user.pw_gid}
    bindir = _bin_dir()
    data = os.path.join(root, "data")
    subprocess.run([os.path.join(bindir, "initdb"), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C",
                    "--no-sync", "-D", data], check=True, capture_output=True, **as_pg)
    port = free_port()
    proc = subprocess.Popen([os.path.join(bindir, "postgres"), "-D", data, "-p", str(port), "-k", root,
                             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_pg)
    url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def up() -> bool:
        try:
            psycopg.connect(url).close()
            return True
        except psycopg.OperationalError:
            return False

    try:
        wait_until("postgres to accept connections", up, timeout_s=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def test_a_job_exists_if_and_only_if_its_transaction_committed(pg: str, tmp_path) -> None:
    data = str(tmp_path / "q")
    cli("init", "--data", data, "--shards", "2")
    cli("pg", "install", "--data", data, "--postgres", pg)
    with psycopg.connect(pg) as conn:
        with conn.transaction(force_rollback=True):
            shardq.pg.enqueue(conn.cursor(), "k", "rolled back")
        with conn.transaction():
            cur = conn.cursor()
            ids = [shardq.pg.enqueue(cur, "k", "text"),
                   shardq.pg.enqueue(cur, "k", b"\xff\x00", dedup_id="order-1", max_attempts=2),
                   shardq.pg.enqueue(cur, "k", {"n": 1}, delay_ms=0)]
        assert ids == sorted(ids)
        for bad, says in [(lambda c: shardq.pg.enqueue(c, "", "p"), "key must not be empty"),
                          (lambda c: shardq.pg.enqueue(c, "k", "p", dedup_id="unique:x"), "prefix shardq keeps"),
                          (lambda c: shardq.pg.enqueue(c, "k", "p", max_attempts=0), "max_attempts 0")]:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match=says):
                with conn.transaction():
                    cur = conn.cursor()
                    shardq.pg.enqueue(cur, "k", "lost with its transaction")
                    bad(cur)
    report = json.loads(cli("pg", "relay", "--data", data, "--postgres", pg, "--exit-when-empty",
                               "--json").stdout.splitlines()[-1])
    assert report["relayed"] == 3, report
    jobs = json.loads(cli("jobs", "--data", data, "--key", "k", "--json").stdout)["jobs"]
    assert [(j.get("payload"), j.get("payload_b64"), j["max_attempts"]) for j in jobs] == [
        ("text", None, 5), (None, "/wA=", 2), ('{"n": 1}', None, 5)], jobs
    assert jobs[1]["dedup_id"] == "order-1"
    status = json.loads(cli("pg", "status", "--postgres", pg, "--json").stdout)
    assert status["depth"] == 0 and status["relay_active"] is False, status


def test_a_bad_schema_name_is_refused_before_any_sql() -> None:
    with pytest.raises(ValueError, match="schema"):
        shardq.pg.enqueue(object(), "k", "p", schema="x; drop table t")
