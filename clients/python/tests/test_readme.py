"""The README's examples run as written: its ``sh`` block (a data dir, a
tokens file, ``shardq serve``) is run with the port changed to a free one,
then every ``python`` block in turn with ``SHARDQ_URLS`` and
``SHARDQ_TOKEN`` pointing at that server (and ``SHARDQ_DATA`` at a Redis
data dir for the Redis producer). A block that runs a worker is stopped with
SIGTERM once the server has nothing left to run, and must exit 0 like the
others."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import List, Tuple

from support import RedisServer, free_port, http_get, read_lines, shardq, shardq_binary, stop_process, totals_of, wait_until

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocks() -> List[Tuple[str, str]]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def test_every_python_block_of_the_readme_runs_against_the_server_its_sh_block_starts(tmp_path):
    sh = [b for lang, b in blocks() if lang == "sh"]
    py = [b for lang, b in blocks() if lang == "python"]
    assert len(sh) == 1 and len(py) >= 5, (len(sh), len(py))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(shardq_binary(), bindir / "shardq")
    port = free_port()
    script = sh[0].replace("127.0.0.1:7070", f"127.0.0.1:{port}")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": PKG}
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(["bash", "-euc", script], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    redis = None
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                status, doc = http_get(url + "/readyz", 0.5)
            except OSError:
                return False
            return status == 200 and len((doc or {}).get("owned", [])) == 4

        wait_until("the README's server", ready, timeout_s=30)
        token = (tmp_path / "tokens.txt").read_text().split()[0]
        env.update(SHARDQ_URLS=url, SHARDQ_TOKEN=token)
        if any("RedisProducer" in b for b in py):
            redis = RedisServer()
            env["SHARDQ_DATA"] = str(tmp_path / "rq")
            shardq("init", "--data", env["SHARDQ_DATA"], "--shards", "2", "--redis", redis.url)
        for i, block in enumerate(py):
            path = tmp_path / f"example_{i}.py"
            path.write_text(block)
            out = tmp_path / f"example_{i}.out"
            with open(out, "wb") as o:
                p = subprocess.Popen([sys.executable, str(path)], cwd=tmp_path, env=env, stdout=o,
                                     stderr=subprocess.STDOUT)
            try:
                if ".run(" in block:
                    # A worker: it runs until stopped, once it has run the jobs.
                    def idle() -> bool:
                        assert p.poll() is None, f"example {i} exited:\n{out.read_text()}"
                        t = totals_of(url, token)
                        return bool(read_lines(str(out))) and t["ready"] == t["in_flight"] == t["delayed"] == 0

                    wait_until(f"example {i} to run every job", idle, timeout_s=30)
                    p.send_signal(signal.SIGTERM)
                rc = p.wait(30)
            finally:
                stop_process(p, f"example {i}", signal.SIGKILL)
            assert rc == 0, f"example {i} exited {rc}:\n{block}\n---\n{out.read_text()}"
        assert totals_of(url, token)["dead"] == 0
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        stop_process(serve, "the README's server")
        log.close()
        if redis is not None:
            redis.stop()
