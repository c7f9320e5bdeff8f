"""The dashboard in a real browser (headless Chromium through Selenium)
against a `shardq serve` with real data. Tests run in file order on one
server: the static checks first, then dead-letter retry, then a live
rebalance under load, then the server going away."""

import math
import re
import shutil
import threading
import time

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from conftest import ADMIN_TOKEN, READ_TOKEN, run, wait_for

WAIT_S = 30


def wait(driver, what, cond, timeout=WAIT_S):
    # The page redraws its tables every poll: an element found a moment
    # ago may be gone; the condition is then tried again.
    return WebDriverWait(
        driver, timeout, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda d: cond(d), message=f"waiting for {what}")


def click(driver, what, css):
    """Clicks the element matching css, trying again if a redraw replaced it."""

    def go(d):
        els = d.find_elements(By.CSS_SELECTOR, css)
        if not els:
            return False
        els[0].click()
        return True

    wait(driver, what, go)


def text(driver, css):
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", css
    )


def use_token(driver, token):
    box = driver.find_element(By.ID, "token-input")
    box.clear()
    box.send_keys(token)
    driver.find_element(By.ID, "token-save").click()


def open_page(driver, deployment, token):
    driver.get(deployment["url"] + "/")
    if token is None:
        driver.find_element(By.ID, "token-clear").click()
    else:
        use_token(driver, token)


def test_without_a_token_or_with_a_wrong_one_the_page_says_so(browser, deployment, screenshots):
    open_page(browser, deployment, None)
    wait(browser, "the 401 banner", lambda d: "needs a bearer token (401)" in text(d, "#banner"))
    use_token(browser, "wrong-token-0000000000000000")
    wait(browser, "the refused-token banner", lambda d: "token was refused (401" in text(d, "#banner"))
    browser.save_screenshot(str(screenshots / "01-wrong-token.png"))


def shard_rows(driver):
    """The shard table as {shard: {column: text}}, read in one go."""
    return driver.execute_script(
        """
        const rows = {};
        for (const tr of document.querySelectorAll('#shards tbody tr')) {
          const cells = {};
          for (const td of tr.querySelectorAll('td')) cells[td.dataset.col] = td.innerText;
          rows[tr.dataset.shard] = cells;
        }
        return rows;
        """
    )


def test_the_shard_table_matches_the_status_endpoint(browser, deployment, screenshots):
    open_page(browser, deployment, READ_TOKEN)
    api = deployment["api"]
    seen = {}

    def matches(d):
        status = api.get("/v1/status")
        rows = shard_rows(d)
        seen["rows"], seen["status"] = rows, status
        if len(rows) != len(status["shards"]) or len(rows) < 3:
            return False
        for s in status["shards"]:
            row = rows.get(s["name"])
            if row is None:
                return False
            for col in ["ready", "delayed", "in_flight", "dead", "keys"]:
                if row[col].replace(",", "") != str(s[col]):
                    return False
            if row["owner"] != (s["owner"] or "none"):
                return False
        return True

    wait(browser, "the shard table to match /v1/status", matches)
    status = seen["status"]
    # Real data: jobs on several shards and one dead letter.
    assert sum(1 for s in status["shards"] if s["ready"] > 0) >= 2, status
    assert status["totals"]["dead"] == 1, status
    assert text(browser, "#conn") == "live"
    # The ring legend shows every shard with a share.
    ring = api.get("/v1/ring")
    legend = browser.execute_script(
        "return [...document.querySelectorAll('#ring-legend tbody tr')].map(t => t.dataset.shard)"
    )
    assert legend == [s["name"] for s in ring["shards"]]
    arcs = browser.execute_script("return document.querySelectorAll('#ring [data-shard]').length")
    assert arcs >= 3, arcs
    # Load bars on one absolute (log) scale: a bar's length follows its own
    # shard's jobs, log10(1 + jobs) / 6 of the track, whatever the others hold.
    bars = browser.execute_script(
        "return [...document.querySelectorAll('#shards tbody tr')].map(t => {"
        " const b = t.querySelector('.bar'); if (!b) return null;"
        " const w = [...b.children].reduce((a, c) => a + parseFloat(c.style.width), 0);"
        " return [t.dataset.shard, Number(b.dataset.length), w / 100]; })"
    )
    by_name = {s["name"]: s for s in status["shards"]}
    for name, length, drawn in [b for b in bars if b]:
        s = by_name[name]
        jobs = s["ready"] + s["delayed"] + s["in_flight"] + s["dead"]
        assert abs(length - math.log10(1 + jobs) / 6) < 0.002, (name, jobs, length)
        assert abs(drawn - length) < 0.02, (name, jobs, length, drawn)
    browser.save_screenshot(str(screenshots / "02-shards.png"))


def test_key_lookup_agrees_with_shardq_route(browser, deployment, shardq, screenshots):
    open_page(browser, deployment, READ_TOKEN)
    for key in ["k-7", "doomed", "nobody-ever-used-this"]:
        out = run(shardq, "route", "--map", str(deployment["data"] / "shardmap.yaml"), key).stdout
        want = out.strip().split("\t")[1]
        box = browser.find_element(By.ID, "key-input")
        box.clear()
        box.send_keys(key)
        before = text(browser, "#key-version") + "|" + key
        browser.execute_script("document.getElementById('key-shard').textContent = ''")
        browser.find_element(By.ID, "key-go").click()
        wait(browser, f"the lookup of {key}", lambda d: text(d, "#key-shard") != "")
        assert text(browser, "#key-shard") == want, (key, before)
        assert text(browser, "#key-computed") == want
    assert text(browser, "#key-override") == "none"
    browser.save_screenshot(str(screenshots / "03-key.png"))


def test_retry_is_refused_without_admin_and_works_with_it(browser, deployment, screenshots):
    api = deployment["api"]
    open_page(browser, deployment, READ_TOKEN)
    click(browser, "the dead letter's retry button", "#dead tbody tr button.retry")
    wait(browser, "the refusal", lambda d: "Refused (403)" in text(d, "#dead-msg"))
    assert "admin" in text(browser, "#dead-msg")
    assert api.get("/v1/status")["totals"]["dead"] == 1
    browser.save_screenshot(str(screenshots / "04-retry-refused.png"))

    use_token(browser, ADMIN_TOKEN)
    click(browser, "the dead letter's retry button", "#dead tbody tr button.retry")
    wait(browser, "the retry", lambda d: "Retried 1 job" in text(d, "#dead-msg"))
    status = api.get("/v1/status")
    assert status["totals"]["dead"] == 0, status
    key = api.get("/v1/keys/doomed")
    assert (key["depth"], key["dead"]) == (1, 0), key
    row = key["shard"]
    wait(browser, "the table to show no dead job", lambda d: shard_rows(d).get(row, {}).get("dead") == "0")
    wait(browser, "the empty dead-letter list", lambda d: d.find_element(By.ID, "dead-empty").is_displayed())


def test_purge_all_needs_a_second_click_naming_the_count(browser, deployment, screenshots):
    """Two dead letters; "Purge all" first asks to confirm with their count,
    and only the second click purges them all."""
    api = deployment["api"]
    placed = api.post("/v1/jobs", {"jobs": [{"key": f"bulk-{i}", "payload": "x", "max_attempts": 1} for i in range(2)]})
    assert len(placed["jobs"]) == 2
    # One claim takes every key's head (fewer than 100 keys have work); the
    # two new ones dead-letter, the others go back to run again.
    for _ in range(3):
        code, v = api.call("POST", "/v1/claim", {"worker": "bulk", "max": 100, "wait_ms": 100})
        assert code == 200, v
        for job in v["jobs"]:
            if job["key"].startswith("bulk-"):
                api.post("/v1/fail", {"receipt": job["receipt"], "reason": "bulk test"})
            else:
                api.call("POST", "/v1/fail", {"receipt": job["receipt"], "retry_in_ms": 0})
        if api.get("/v1/status")["totals"]["dead"] >= 2:
            break
    dead = api.get("/v1/status")["totals"]["dead"]
    assert dead >= 2, dead
    open_page(browser, deployment, ADMIN_TOKEN)
    click(browser, "purge all", "#dead-purge-all")
    wait(browser, "the confirm label with the count", lambda d: f"Confirm: purge {dead}" in text(d, "#dead-purge-all"))
    assert api.get("/v1/status")["totals"]["dead"] == dead, "one click purged"
    click(browser, "the confirm", "#dead-purge-all")
    wait(browser, "the purge", lambda d: f"Purged {dead} dead job" in text(d, "#dead-msg"))
    assert api.get("/v1/status")["totals"]["dead"] == 0


def test_a_keys_jobs_a_job_page_and_a_cancel(browser, deployment, screenshots):
    """The key lookup lists the key's live jobs; a job id opens the job
    panel with its state and payload (as text: markup in a payload stays
    text); a cancel needs admin and a second click, and the job is gone."""
    api = deployment["api"]
    hostile = "<img src=x onerror=\"document.title='pwned'\">"
    placed = api.post("/v1/jobs", {"jobs": [
        {"key": "page-k", "payload": p, "delay_ms": 3_600_000} for p in (hostile, "second", "third")
    ]})["jobs"]
    ids = [j["id"] for j in placed]
    open_page(browser, deployment, READ_TOKEN)
    box = browser.find_element(By.ID, "key-input")
    box.clear()
    box.send_keys("page-k")
    browser.find_element(By.ID, "key-go").click()
    wait(browser, "the key's jobs", lambda d: len(d.find_elements(By.CSS_SELECTOR, "#key-jobs tbody tr")) == 3)
    states = [r.get_attribute("data-state") for r in browser.find_elements(By.CSS_SELECTOR, "#key-jobs tbody tr")]
    assert states == ["delayed"] * 3, states
    # A search by prefix finds the key, and a click on it looks it up.
    box.clear()
    box.send_keys("page-")
    browser.find_element(By.ID, "key-search").click()
    wait(browser, "the matching key", lambda d: d.find_elements(By.CSS_SELECTOR, '#key-matches li[data-key="page-k"] a.key-link'))
    assert "3 queued" in text(browser, '#key-matches li[data-key="page-k"]')
    click(browser, "the matching key", '#key-matches li[data-key="page-k"] a.key-link')
    wait(browser, "the key looked up again", lambda d: d.find_element(By.ID, "key-input").get_attribute("value") == "page-k")
    click(browser, "the first job's link", "#key-jobs tbody tr a.job-link")
    wait(browser, "the job panel", lambda d: text(d, "#job-id") == ids[0])
    assert text(browser, "#job-state") == "delayed"
    assert browser.find_element(By.ID, "job-payload").text == hostile
    assert not browser.find_elements(By.CSS_SELECTOR, "#job-panel img")
    assert browser.title != "pwned"
    browser.save_screenshot(str(screenshots / "04b-job-page.png"))

    # A read token: the cancel is refused, and nothing changed.
    click(browser, "the cancel button", "#job-cancel")
    click(browser, "the confirm", "#job-cancel")
    wait(browser, "the refusal", lambda d: "Refused (403)" in text(d, "#job-msg"))
    assert api.get("/v1/jobs/" + ids[0])["state"] == "delayed"

    use_token(browser, ADMIN_TOKEN)
    row = f'#key-jobs tbody tr[data-job="{ids[1]}"] button.cancel'
    click(browser, "the row's cancel", row)
    wait(browser, "the confirm label", lambda d: "Confirm" in text(d, row))
    assert api.get("/v1/jobs/" + ids[1])["state"] == "delayed", "one click cancelled"
    click(browser, "the row's confirm", row)
    wait(browser, "the cancel", lambda d: "Cancelled " + ids[1] in text(d, "#job-msg"))
    wait(browser, "the row gone", lambda d: not d.find_elements(By.CSS_SELECTOR, f'#key-jobs tbody tr[data-job="{ids[1]}"]'))
    # The cancelled job now shows among the key's finished jobs.
    wait(browser, "the finished job", lambda d: d.find_elements(
        By.CSS_SELECTOR, f'#key-finished tbody tr[data-job="{ids[1]}"][data-outcome="cancelled"]'))
    code, v = api.call("GET", "/v1/jobs/" + ids[1])
    assert code == 200 and v["outcome"] == "cancelled", v
    for i in (ids[0], ids[2]):
        code, v = api.call("DELETE", "/v1/jobs/" + i, {})
        assert code == 200, v


class Load:
    """A producer that keeps enqueueing and a slow remote worker (claim,
    work a little, ack) over the API, so keys have backlogs to move."""

    def __init__(self, api):
        self.api = api
        self.stop = threading.Event()
        self.errors = []
        self.threads = [threading.Thread(target=self.produce), threading.Thread(target=self.work)]

    def produce(self):
        n = 0
        while not self.stop.is_set():
            jobs = [{"key": f"k-{(n + i) % 30}", "payload": f"p{n}"} for i in range(3)]
            code, v = self.api.call("POST", "/v1/jobs", {"jobs": jobs})
            if code != 200 and code != 503:
                self.errors.append((code, v))
            n += 3
            self.stop.wait(0.1)

    def work(self):
        while not self.stop.is_set():
            code, v = self.api.call("POST", "/v1/claim", {"worker": "browser-test", "max": 4, "wait_ms": 200})
            if code != 200:
                self.errors.append((code, v))
                continue
            for job in v["jobs"]:
                time.sleep(0.01)  # the job's work
                code, r = self.api.call("POST", "/v1/ack", {"receipts": [job["receipt"]]})
                if code not in (200, 409):
                    self.errors.append((code, r))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_a_rebalance_shows_its_phase_and_moved_keys(browser, deployment, screenshots):
    api = deployment["api"]
    open_page(browser, deployment, ADMIN_TOKEN)
    wait(browser, "the page to be live", lambda d: text(d, "#conn") == "live")
    phases, moved, speeds, pins = [], [], [], []
    shot = screenshots / "05-rebalance.png"
    with Load(api) as load:
        api.post("/v1/admin/add-shard", {"name": "shard-3", "weight": 2})
        wait(browser, "the pending target", lambda d: text(d, "#rebalance-phase").lower() == "pending")
        phases.append("pending")
        # A key moves with its backlog once its run in flight ends: hold
        # one run of every key and end them one at a time while the page
        # watches, in the order the rebalance takes the keys, so its
        # progress shows in steps.
        held = api.post("/v1/claim", {"worker": "holder", "max": 30, "lease_ms": 120000})["jobs"]
        held.sort(key=lambda j: j["key"])
        api.post("/v1/admin/rebalance", {"batch": 1})

        def watch(d):
            p = text(d, "#rebalance-phase").lower()
            m = text(d, "#rebalance-moved")
            if not phases or phases[-1] != p:
                phases.append(p)
            if not moved or moved[-1] != m:
                moved.append(m)
            if held and p == "moving":
                api.post("/v1/ack", {"receipts": [held.pop(0)["receipt"]]})
            if p == "moving":
                speeds.append(text(d, "#rebalance-speed"))
                pins.append(text(d, "#ring-pinned"))
            if p == "moving" and m not in ("", "0"):
                # The last view while keys move is kept.
                d.save_screenshot(str(shot))
            return p in ("finished", "failed")

        wait(browser, "the rebalance to finish on the page", watch, timeout=180)
        for job in held:
            api.call("POST", "/v1/ack", {"receipts": [job["receipt"]]})
        assert not load.errors, load.errors[:5]
    progress = api.get("/v1/admin/rebalance")
    assert progress["phase"] == "finished", progress
    assert progress["runner"].startswith("shardq serve"), progress
    # The finished run stays on the page: who ran it and how long it took.
    wait(browser, "the finished run's line",
         lambda d: re.search(r"by shardq serve .*finished after \d+\.\d s", text(d, "#rebalance-run")))
    assert "moving" in phases, phases
    assert phases[-1] == "finished", phases
    assert len(set(moved)) >= 3, f"moved-key count seen on the page: {moved}"
    # While keys moved, the page gave the time left at the switch rate.
    assert any(re.search(r"about \d+ s left", sp) for sp in speeds), speeds[-5:]
    # And the routing panel named the keys still pinned against the arcs.
    assert any("still pinned to the old shard" in p for p in pins), pins[-5:]
    assert shot.exists(), "no screenshot was taken while keys were moving"
    # The new shard is active on the page and owns part of the circle.
    wait(browser, "shard-3 active", lambda d: shard_rows(d).get("shard-3", {}).get("state") == "active")
    browser.save_screenshot(str(screenshots / "06-after.png"))
    if deployment.get("keep_shot"):
        shutil.copy(shot, deployment["keep_shot"])


def test_the_throughput_chart_shows_the_servers_own_counts(browser, deployment, screenshots):
    """After the load above, the chart's totals are the server's history
    totals and its lines span the last ten minutes, or the last hour when
    asked, one point per second."""
    api = deployment["api"]
    open_page(browser, deployment, READ_TOKEN)
    h = api.get("/v1/history")
    assert h["totals"]["acked"] > 0 and len(h["acked"]) == 3600, h["totals"]
    assert sum(h["acked"]) <= h["totals"]["acked"]

    def shown_acked(d):
        t = text(d, "#flow-acked").replace(",", "")
        return t.isdigit() and int(t) >= h["totals"]["acked"]

    wait(browser, "the processed total", shown_acked)
    if sum(h["claimed"][-50:]) > 0:
        wait(browser, "the last minute's waits", lambda d: re.search(r"mean [\d,]+ ms, longest [\d,]+ ms", text(d, "#flow-wait")))
    points = "const p = document.querySelector('#flow polyline.acked'); return p ? p.getAttribute('points').split(' ').length : 0;"
    wait(browser, "ten minutes of points", lambda d: d.execute_script(points) == 600)
    click(browser, "the hour button", "#flow-3600")
    wait(browser, "an hour of points", lambda d: d.execute_script(points) == 3600)
    browser.save_screenshot(str(screenshots / "06-throughput.png"))


def test_the_flow_panel_shows_a_groups_limit_and_the_keys_it_holds(browser, deployment, screenshots):
    """A group's limit is shown beside what this server started under it,
    and a key the group holds back is listed with the group as the reason;
    a group that caps runs at once shows its runs against the cap."""
    api = deployment["api"]
    code, v = api.call("PUT", "/v1/groups/dash-api", {"rate": "1/m", "burst": 2})
    assert code == 200, v
    code, v = api.call("PUT", "/v1/policies/flowtest:?scope=prefix", {"group": "dash-api"})
    assert code == 200, v
    # The server reads the settings again within a second: the jobs go in
    # once it uses them (before, their claims may start all four).
    wait_for("the server to use the new group",
             lambda: "dash-api" in api.get("/v1/status")["flow"]["groups"], timeout_s=20)
    api.post("/v1/jobs", {"jobs": [{"key": f"flowtest:{i}", "payload": "p"} for i in range(4)]})
    # Claim until two runs of the group started and the others are held
    # back.
    started = []

    def claimed_two():
        got = api.post("/v1/claim", {"worker": "dash", "max": 16, "wait_ms": 0})["jobs"]
        for j in got:
            api.post("/v1/ack", {"receipts": [j["receipt"]]})
        started.extend(j["key"] for j in got if j["key"].startswith("flowtest:"))
        held = api.get("/v1/status")["flow"]["held_keys"]
        return len(started) >= 2 and any(h["by"] == "group dash-api" for h in held)

    wait_for("two starts, then keys held by the group", claimed_two, timeout_s=20)
    assert len(started) == 2, started
    open_page(browser, deployment, READ_TOKEN)
    row = '#flow-groups tr[data-group="dash-api"]'
    wait(browser, "the group's row", lambda d: "1/m (burst 2)" in text(d, row))
    wait(browser, "a held key with its reason", lambda d: "group dash-api" in text(d, "#flow-held"))
    # A group that caps runs at once, with no rate, with one run holding a
    # slot: its row shows the runs against the limit.
    code, v = api.call("PUT", "/v1/groups/dash-db", {"concurrency": 3})
    assert code == 200, v
    code, v = api.call("PUT", "/v1/policies/slottest:?scope=prefix", {"group": "dash-db"})
    assert code == 200, v
    # The server reads the settings again within a second.
    wait_for("the server to use the new group",
             lambda: "dash-db" in api.get("/v1/status")["flow"]["groups"], timeout_s=20)
    api.post("/v1/jobs", {"jobs": [{"key": "slottest:a", "payload": "p"}]})
    running = []

    def one_running():
        got = api.post("/v1/claim", {"worker": "dash", "max": 16, "wait_ms": 0})["jobs"]
        for j in got:
            if j["key"].startswith("slottest:"):
                running.append(j)
            else:
                api.post("/v1/ack", {"receipts": [j["receipt"]]})
        return bool(running)

    wait_for("a run of the capped group", one_running, timeout_s=20)
    assert api.get("/v1/status")["flow"]["groups"]["dash-db"]["running"] == 1
    capped = '#flow-groups tr[data-group="dash-db"]'
    wait(browser, "the capped group's runs", lambda d: "1 of 3" in text(d, capped) and "none" in text(d, capped))
    browser.save_screenshot(str(screenshots / "07-flow.png"))
    api.post("/v1/ack", {"receipts": [running[0]["receipt"]]})


def test_the_server_panel_shows_a_waiting_reader_against_its_bound(browser, deployment, screenshots):
    """A client waiting for a job's result (a long poll of a job that is
    not due for a minute) shows in the server panel as a poll in service
    and waiting, against the server's bound, and leaves it once answered."""
    import threading

    api = deployment["api"]
    placed = api.post("/v1/jobs", {"jobs": [{"key": "dash-later", "payload": "x", "delay_ms": 60000}]})
    job = placed["jobs"][0]["id"]
    open_page(browser, deployment, READ_TOKEN)
    polls = '#server-polls'
    wait(browser, "the panel", lambda d: "0 waiting" in text(d, polls) and " of " in text(d, polls))
    answered = []
    reader = threading.Thread(target=lambda: answered.append(api.get(f"/v1/jobs/{job}/result?wait_ms=6000")))
    reader.start()
    wait_for("the server to count the waiting reader",
             lambda: api.get("/v1/status")["server"]["polls_waiting"] == 1, timeout_s=20)
    wait(browser, "the waiting reader", lambda d: "1 waiting" in text(d, polls))
    browser.save_screenshot(str(screenshots / "09-server.png"))
    reader.join(30)
    assert answered and answered[0]["state"] == "delayed", answered
    wait(browser, "the reader gone", lambda d: "0 waiting" in text(d, polls))
    code, v = api.call("DELETE", f"/v1/jobs/{job}", {})
    assert code == 200, v


def test_the_schedules_panel_shows_fires_and_pauses_a_schedule(browser, deployment, screenshots):
    """A schedule firing every second shows its fires, its last job and
    its next fire; Pause needs admin, and the row then says paused while
    the stored schedule is paused."""
    api = deployment["api"]
    code, v = api.call("PUT", "/v1/schedules/dash-beat", {"key": "sched:dash", "every": "1s", "overlap": "all"})
    assert code == 200, v
    wait_for("two fires", lambda: api.get("/v1/schedules/dash-beat")["state"]["fired"] >= 2, timeout_s=30)
    open_page(browser, deployment, READ_TOKEN)
    row = '#schedules tr[data-schedule="dash-beat"]'
    wait(browser, "the schedule's row", lambda d: "every 1 s" in text(d, row) and "sched:dash" in text(d, row))
    wait(browser, "its last job", lambda d: "→" in text(d, row))
    click(browser, "the pause button", row + " button.pause")
    wait(browser, "the refusal", lambda d: "403" in text(d, "#schedules-msg"))
    assert api.get("/v1/schedules/dash-beat")["paused"] is False
    use_token(browser, ADMIN_TOKEN)
    click(browser, "the pause button", row + " button.pause")
    wait(browser, "paused", lambda d: "paused" in text(d, row))
    assert api.get("/v1/schedules/dash-beat")["paused"] is True
    browser.save_screenshot(str(screenshots / "08-schedules.png"))
    code, v = api.call("DELETE", "/v1/schedules/dash-beat", {})
    assert code == 200, v


def test_a_dependent_shows_as_a_small_graph_of_its_dependencies(browser, deployment, screenshots):
    """A dependent's @N id opens the job panel with its dependencies drawn
    as nodes coloured by outcome (one pending, one cancelled) and the
    dependent waiting; once the last dependency ends the graph shows it
    released, and the shards panel counts the deployment's dependents."""
    api = deployment["api"]
    placed = api.post("/v1/jobs", {"jobs": [
        {"key": "dep-a", "payload": "a", "delay_ms": 3_600_000},
        {"key": "dep-b", "payload": "b", "delay_ms": 3_600_000},
    ]})["jobs"]
    a, b = placed[0]["id"], placed[1]["id"]
    dep = api.post("/v1/jobs", {"jobs": [
        {"key": "dep-end", "payload": "end", "after": [a, b], "on_dependency_failure": "run"},
    ]})["jobs"][0]["id"]
    assert dep.startswith("@"), dep
    code, v = api.call("DELETE", f"/v1/jobs/{b}", {})
    assert code == 200, v
    wait_for("b's end to be recorded",
             lambda: api.get(f"/v1/jobs/{dep}")["after"][1]["outcome"] == "cancelled", timeout_s=20)
    open_page(browser, deployment, READ_TOKEN)
    box = browser.find_element(By.ID, "job-input")
    box.clear()
    box.send_keys(dep)
    browser.find_element(By.ID, "job-go").click()
    node = '#job-graph-svg g[data-dep="{}"]'
    wait(browser, "the graph", lambda d: d.find_elements(By.CSS_SELECTOR, node.format(a)))
    outcome = lambda d, i: d.find_element(By.CSS_SELECTOR, node.format(i)).get_attribute("data-outcome")
    assert (outcome(browser, a), outcome(browser, b)) == ("pending", "cancelled")
    me = f'#job-graph-svg g[data-dependent="{dep}"]'
    assert browser.find_element(By.CSS_SELECTOR, me).get_attribute("data-state") == "waiting"
    assert "2 dependencies, 1 not ended" in text(browser, "#job-graph-note")
    wait(browser, "the dependents line", lambda d: "waiting for their dependencies" in text(d, "#dependents-line"))
    browser.save_screenshot(str(screenshots / "10-dependent.png"))
    code, v = api.call("DELETE", f"/v1/jobs/{a}", {})
    assert code == 200, v
    wait_for("the dependent's release", lambda: api.get(f"/v1/jobs/{dep}")["state"] == "released", timeout_s=20)
    browser.find_element(By.ID, "job-go").click()
    wait(browser, "the graph updated",
         lambda d: d.find_element(By.CSS_SELECTOR, me).get_attribute("data-state") == "released")
    assert outcome(browser, a) == "cancelled"
    code, v = api.call("DELETE", f"/v1/jobs/{dep}", {})
    assert code == 200, v


def test_a_batch_shows_its_progress_and_callbacks(browser, deployment, screenshots):
    """A batch's @N id opens the job panel with its progress as a bar
    (completed and dead parts with their counts) and its callbacks, the
    death one fired at the dead job while the batch is open; once it is
    closed the complete callback shows fired too."""
    api = deployment["api"]
    bid = api.post("/v1/batches", {"key": "batch-cb", "on_complete": "sum", "on_death": "alert"})["id"]
    api.post("/v1/jobs", {"jobs": [
        {"key": "batch-a", "payload": "a", "batch": bid},
        {"key": "batch-b", "payload": "b", "batch": bid},
        {"key": "batch-c", "payload": "die", "batch": bid, "max_attempts": 1},
    ]})
    ran = set()

    def run_them():
        for j in api.post("/v1/claim", {"worker": "batch-test", "max": 16, "wait_ms": 0})["jobs"]:
            if j["payload"] == "die":
                api.post("/v1/fail", {"receipt": j["receipt"], "reason": "boom"})
            else:
                api.post("/v1/ack", {"receipts": [j["receipt"]]})
            if j.get("batch") == bid and "batch_callback" not in j:
                ran.add(j["key"])
        return ran >= {"batch-a", "batch-b", "batch-c"}

    wait_for("the batch's jobs to run", run_them, timeout_s=20)
    wait_for("the death callback",
             lambda: api.get(f"/v1/batches/{bid}")["callbacks"]["death"]["fired"] is not None, timeout_s=20)
    open_page(browser, deployment, READ_TOKEN)
    box = browser.find_element(By.ID, "job-input")
    box.clear()
    box.send_keys(bid)
    browser.find_element(By.ID, "job-go").click()
    part = '#job-graph-svg g[data-part="{}"]'
    wait(browser, "the bar", lambda d: d.find_elements(By.CSS_SELECTOR, part.format("completed")))
    assert browser.find_element(By.CSS_SELECTOR, part.format("completed")).get_attribute("data-count") == "2"
    assert browser.find_element(By.CSS_SELECTOR, part.format("dead")).get_attribute("data-count") == "1"
    fired = lambda d, k: d.find_element(By.CSS_SELECTOR, f'#job-graph-svg g[data-callback="{k}"]').get_attribute("data-fired")
    assert (fired(browser, "death"), fired(browser, "complete")) == ("yes", "no")
    assert "Batch open: 3 jobs, 2 completed, 1 dead" in text(browser, "#job-graph-note")
    browser.save_screenshot(str(screenshots / "11-batch.png"))
    api.post(f"/v1/batches/{bid}/close", {})
    wait_for("the batch to complete", lambda: api.get(f"/v1/batches/{bid}")["state"] == "complete", timeout_s=20)
    browser.find_element(By.ID, "job-go").click()
    wait(browser, "the complete callback fired", lambda d: fired(d, "complete") == "yes")
    assert "Batch complete" in text(browser, "#job-graph-note")
    wait(browser, "the batches line", lambda d: "callbacks fired" in text(d, "#dependents-line"))


def test_the_page_says_when_the_server_is_down(browser, deployment, screenshots):
    open_page(browser, deployment, READ_TOKEN)
    wait(browser, "the page to be live", lambda d: text(d, "#conn") == "live")
    proc = deployment["proc"]
    proc.terminate()
    proc.wait(timeout=60)
    wait(browser, "the server-down banner", lambda d: "Server down or unreachable" in text(d, "#banner"))
    browser.save_screenshot(str(screenshots / "08-down.png"))
