"""Fixtures of the dashboard's browser tests: the shardq binary, a data dir
with real work (jobs on several shards, one dead letter), a `shardq serve`
with an admin and a read-only token, and headless Chromium driven by
Selenium. Missing tools fail the run; nothing is skipped.

The browser only ever loads the loopback server started here.
"""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "admin-token-0123456789abcdef"
READ_TOKEN = "reader-token-0123456789abcdef"
START_TIMEOUT_S = 60


def _find_binary():
    env = os.environ.get("SHARDQ_BIN")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"SHARDQ_BIN={env!r} is not a file")
        return Path(env)
    path = ROOT / "target" / "debug" / "shardq"
    if not path.is_file():
        build = subprocess.run(["cargo", "build", "-p", "shardq"], cwd=ROOT)
        if build.returncode != 0 or not path.is_file():
            pytest.fail(f"cannot build the shardq binary ({path}): cargo build -p shardq failed")
    return path


@pytest.fixture(scope="session")
def shardq():
    return _find_binary()


def run(binary, *args, stdin=None, check=True):
    p = subprocess.run(
        [str(binary), *args], input=stdin, capture_output=True, text=True, timeout=120
    )
    if check and p.returncode != 0:
        raise AssertionError(f"shardq {' '.join(args)} exited {p.returncode}: {p.stderr}")
    return p


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    """A tiny JSON client of the server under test."""

    def __init__(self, base, token):
        self.base = base
        self.token = token

    def call(self, method, path, body=None, token=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        t = self.token if token is None else token
        if t:
            req.add_header("Authorization", "Bearer " + t)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get(self, path):
        code, v = self.call("GET", path)
        assert code == 200, f"GET {path}: {code} {v}"
        return v

    def post(self, path, body):
        code, v = self.call("POST", path, body)
        assert code in (200, 202), f"POST {path}: {code} {v}"
        return v


def wait_for(what, fn, timeout_s=START_TIMEOUT_S, every_s=0.1):
    """Polls fn until it returns a true value; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - reported below
            last = e
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last error: {last})")


@pytest.fixture(scope="module")
def deployment(shardq, tmp_path_factory):
    """A data dir with 3 shards, 30 keys with backlogs and one dead letter,
    served by `shardq serve` with tokens."""
    base = tmp_path_factory.mktemp("shardq-dashboard")
    data = base / "data"
    run(shardq, "init", "--data", str(data), "--shards", "3")
    # One job that fails once and is dead-lettered, before anything else.
    run(shardq, "enqueue", "--data", str(data), "--key", "doomed", "--payload", "x",
        "--max-attempts", "1")
    run(shardq, "work", "--data", str(data), "--max-local-shards", "all",
        "--lease-ms", "2000", "--exit-when-idle", "--", "false")
    # Backlogs of 1..30 jobs: during a rebalance the moving keys drain one
    # after another, over seconds.
    lines = "".join(f"k-{k}\t{i}\n" for k in range(30) for i in range(k + 1))
    run(shardq, "enqueue", "--data", str(data), "--stdin", stdin=lines)
    tokens = base / "tokens"
    tokens.write_text(f"# dashboard tests\n{ADMIN_TOKEN} admin,read,produce,work\n{READ_TOKEN} read\n")
    port = free_port()
    log = open(base / "serve.log", "w")
    proc = subprocess.Popen(
        [str(shardq), "serve", "--data", str(data), "--listen", f"127.0.0.1:{port}",
         "--tokens", str(tokens), "--lease-ms", "3000"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    api = Api(url, ADMIN_TOKEN)

    def healthy():
        if proc.poll() is not None:
            pytest.fail(f"shardq serve exited {proc.returncode}: {(base / 'serve.log').read_text()}")
        try:
            return api.call("GET", "/readyz")[0] == 200
        except OSError:
            return False

    wait_for("shardq serve to answer /readyz", healthy)
    info = {"data": data, "url": url, "api": api, "proc": proc, "base": base}
    yield info
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


@pytest.fixture(scope="session")
def screenshots():
    d = Path(os.environ.get("SHARDQ_SCREENSHOTS") or tempfile.mkdtemp(prefix="shardq-dashboard-shots-"))
    d.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots in {d}")
    return d


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.fail(
            "the browser tests need Debian's chromium and chromium-driver "
            f"(found chromium={chromium!r}, chromedriver={driver_path!r}): "
            "apt-get install -y chromium chromium-driver"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.fail(f"the browser tests need selenium (python3 -m pip install selenium): {e}")
    os.environ.setdefault("SE_OFFLINE", "true")
    profile = tempfile.mkdtemp(prefix="shardq-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
              "--window-size=1440,1500"]:
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
