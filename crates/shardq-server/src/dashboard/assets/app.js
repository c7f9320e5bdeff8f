// shardq dashboard: polls this server's JSON API (at most once a second)
// and draws what it reads. Plain DOM, no dependencies; data is always put
// in the page as text, never as markup.
"use strict";

(function () {
  const POLL_MS = 1000;
  const SLOW_MS = 2000; // ring, hot keys and dead letters every 2 s
  const TOKEN_KEY = "shardq.dashboard.token";
  const HISTORY_MAX = 600; // polls of rate history kept (about 10 minutes)
  const STALE_RUN_MS = 6 * 60 * 1000; // above the rebalance's 5-minute drain timeout
  const LOAD_SCALE_MAX = 1e6; // jobs at a full load bar (log scale: 1, 1k, 1M)

  const $ = (id) => document.getElementById(id);
  const state = {
    prev: null,          // { t, backlog: {shard: n} } of the last status poll
    history: [],         // [{ t, rate }] total backlog change per second
    shardInfo: {},       // name -> { state, weight } from /v1/ring
    ringIndex: [],       // map index -> name
    rebalanceStart: null, // ms when a rebalance was first seen running
    movedSeen: [],       // [{ t, moved }] while moving
    lastSlow: 0,         // when ring, hot keys and dead letters were last read
    deadArmed: null,     // id whose purge waits for a second click
    cancelArmed: null,   // id whose cancel waits for a second click
    job: null,           // the job shown in the job panel
    key: null,           // the key shown in the key panel
    flowSeconds: 600,    // the throughput chart's window
    flowPrev: null,      // { now_ms, groups } of the last status poll's flow
  };

  // ---------------------------------------------------------------- token
  function token() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
  }
  function setToken(t) {
    try {
      if (t) { sessionStorage.setItem(TOKEN_KEY, t); } else { sessionStorage.removeItem(TOKEN_KEY); }
    } catch (e) { /* storage refused: the token lives for this page only */ }
    showTokenState();
  }
  function showTokenState() {
    $("token-state").textContent = token() ? "token set" : "no token";
  }

  // ------------------------------------------------------------------ http
  class HttpError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(method, path, body) {
    const headers = { "Accept": "application/json" };
    const t = token();
    if (t) headers["Authorization"] = "Bearer " + t;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let resp;
    try {
      resp = await fetch(path, {
        method, headers, cache: "no-store",
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch (e) {
      throw new HttpError(0, "the server does not answer (" + e.message + ")");
    }
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (!resp.ok) {
      const msg = data && data.error ? data.error : resp.status + " " + resp.statusText;
      throw new HttpError(resp.status, msg);
    }
    return data;
  }

  function authMessage(e) {
    if (e.status === 401) {
      return token()
        ? "The token was refused (401: unknown token). Paste a valid one above."
        : "This server needs a bearer token (401). Paste one with the read role above.";
    }
    if (e.status === 403) return "The token lacks a role this needs (403): " + e.message;
    if (e.status === 0) return "Server down or unreachable at " + location.origin + ": " + e.message + ". Retrying every second.";
    return null;
  }

  // ------------------------------------------------------------ formatting
  const fmt = (n) => (n === null || n === undefined) ? "–" : Number(n).toLocaleString("en-US");
  function fmtRate(r) {
    if (r === null || r === undefined || !isFinite(r)) return "–";
    const s = Math.abs(r) < 10 ? r.toFixed(1) : Math.round(r).toString();
    return (r > 0 ? "+" : "") + s + "/s";
  }
  const pct = (x) => (100 * x).toFixed(1) + "%";
  function color(i) { return "hsl(" + ((i * 137.508 + 200) % 360).toFixed(0) + " 60% 50%)"; }
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    if (attrs) for (const k in attrs) {
      if (k === "class") e.className = attrs[k];
      // Through the CSSOM: the page's CSP (style-src 'self') refuses
      // style attributes, which would leave such an element unstyled.
      else if (k === "style") {
        for (const decl of String(attrs[k]).split(";")) {
          const i = decl.indexOf(":");
          if (i > 0) e.style.setProperty(decl.slice(0, i).trim(), decl.slice(i + 1).trim());
        }
      }
      else e.setAttribute(k, attrs[k]);
    }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  // ----------------------------------------------------------------- banner
  function setConn(ok, message) {
    const c = $("conn");
    const b = $("banner");
    if (ok) {
      c.className = "badge ok";
      c.textContent = "live";
      b.hidden = true;
      b.textContent = "";
    } else {
      c.className = "badge bad";
      c.textContent = "no data";
      b.hidden = false;
      b.textContent = message;
    }
  }

  // ----------------------------------------------------------------- shards
  function renderShards(st) {
    const now = Date.now();
    const tbody = $("shards").querySelector("tbody");
    clear(tbody);
    const backlog = {};
    let totalRate = 0;
    let haveRate = false;
    const dt = state.prev ? (now - state.prev.t) / 1000 : 0;
    for (const s of st.shards) {
      const info = state.shardInfo[s.name] || {};
      const tr = el("tr", { "data-shard": s.name, class: s.error ? "err-row" : "" });
      tr.appendChild(el("td", { "data-col": "name" }, s.name));
      tr.appendChild(el("td", { "data-col": "state", class: "state-" + (info.state || "") }, info.state || "?"));
      tr.appendChild(el("td", { "data-col": "weight", class: "num" }, info.weight === undefined ? "?" : info.weight));
      for (const col of ["ready", "delayed", "in_flight", "dead", "keys"]) {
        tr.appendChild(el("td", { "data-col": col, class: "num" }, fmt(s[col])));
      }
      let rate = null;
      if (s.error === null && s.ready !== null) {
        const b = s.ready + s.delayed + s.in_flight;
        backlog[s.name] = b;
        if (state.prev && dt > 0 && state.prev.backlog[s.name] !== undefined) {
          rate = (b - state.prev.backlog[s.name]) / dt;
          totalRate += rate;
          haveRate = true;
        }
      }
      tr.appendChild(el("td", { "data-col": "rate", class: "num" }, fmtRate(rate)));
      tr.appendChild(el("td", { "data-col": "owner" }, s.owner || "none"));
      const left = s.lease_expires_ms ? Math.max(0, (s.lease_expires_ms - now) / 1000) : null;
      tr.appendChild(el("td", { "data-col": "lease", class: "num" }, left === null ? "–" : left.toFixed(1) + " s"));
      const barCell = el("td", { "data-col": "bars" });
      if (s.error) {
        barCell.textContent = s.error;
        barCell.className = "error";
      } else {
        const bar = el("div", { class: "bar", title: "ready " + s.ready + ", delayed " + s.delayed + ", in flight " + s.in_flight + ", dead " + s.dead });
        const parts = [["ready", s.ready], ["delayed", s.delayed], ["inflight", s.in_flight], ["dead", s.dead]];
        // An absolute scale, the same for every shard and refresh: the bar's
        // length is log10(1 + jobs) of LOAD_SCALE_MAX's, shared by the parts
        // in proportion to their counts.
        const load = parts.reduce((a, [, n]) => a + (n || 0), 0);
        const length = Math.min(1, Math.log10(1 + load) / Math.log10(1 + LOAD_SCALE_MAX));
        bar.dataset.length = length.toFixed(4);
        for (const [cls, n] of parts) {
          if (n > 0) bar.appendChild(el("span", { class: cls, style: "width:" + (100 * length * n / load).toFixed(2) + "%" }));
        }
        barCell.appendChild(bar);
      }
      tr.appendChild(barCell);
      tbody.appendChild(tr);
    }
    const tot = $("totals");
    for (const col of ["ready", "delayed", "in_flight", "dead"]) {
      tot.querySelector('[data-col="' + col + '"]').textContent = fmt(st.totals[col]);
    }
    tot.querySelector('[data-col="rate"]').textContent = haveRate ? fmtRate(totalRate) : "–";
    if (haveRate) {
      state.history.push({ t: now, rate: totalRate });
      if (state.history.length > HISTORY_MAX) state.history.shift();
    }
    state.prev = { t: now, backlog };
    $("shards-updated").textContent = "updated " + new Date(now).toLocaleTimeString();
  }

  // ------------------------------------------------------------------- ring
  function arcPath(cx, cy, r, a, b) {
    const ang = (f) => 2 * Math.PI * f - Math.PI / 2;
    const x1 = cx + r * Math.cos(ang(a)), y1 = cy + r * Math.sin(ang(a));
    const x2 = cx + r * Math.cos(ang(b)), y2 = cy + r * Math.sin(ang(b));
    const large = (b - a) > 0.5 ? 1 : 0;
    return "M" + x1.toFixed(3) + " " + y1.toFixed(3) + " A" + r + " " + r + " 0 " + large + " 1 " + x2.toFixed(3) + " " + y2.toFixed(3);
  }

  function renderRing(ring) {
    state.shardInfo = {};
    state.ringIndex = ring.shards.map((s) => s.name);
    ring.shards.forEach((s) => { state.shardInfo[s.name] = { state: s.state, weight: s.weight }; });
    const svg = $("ring");
    const NS = "http://www.w3.org/2000/svg";
    clear(svg);
    const cx = 120, cy = 120, r = 92;
    const base = document.createElementNS(NS, "circle");
    base.setAttribute("cx", cx); base.setAttribute("cy", cy); base.setAttribute("r", r);
    base.setAttribute("fill", "none"); base.setAttribute("stroke", "#eef0f4"); base.setAttribute("stroke-width", "30");
    svg.appendChild(base);
    for (const a of ring.arcs) {
      const name = ring.shards[a.shard].name;
      let shape;
      if (a.end - a.start >= 0.999999) {
        shape = document.createElementNS(NS, "circle");
        shape.setAttribute("cx", cx); shape.setAttribute("cy", cy); shape.setAttribute("r", r);
      } else {
        shape = document.createElementNS(NS, "path");
        shape.setAttribute("d", arcPath(cx, cy, r, a.start, a.end));
      }
      shape.setAttribute("fill", "none");
      shape.setAttribute("stroke", color(a.shard));
      shape.setAttribute("stroke-width", "30");
      shape.setAttribute("data-shard", name);
      const title = document.createElementNS(NS, "title");
      title.textContent = name + ": " + pct(a.end - a.start) + " of the space here";
      shape.appendChild(title);
      svg.appendChild(shape);
    }
    const label = document.createElementNS(NS, "text");
    label.setAttribute("x", cx); label.setAttribute("y", cy - 4);
    label.setAttribute("text-anchor", "middle"); label.setAttribute("font-size", "15"); label.setAttribute("font-weight", "700");
    label.textContent = ring.algorithm;
    svg.appendChild(label);
    const sub = document.createElementNS(NS, "text");
    sub.setAttribute("x", cx); sub.setAttribute("y", cy + 14);
    sub.setAttribute("text-anchor", "middle"); sub.setAttribute("font-size", "11"); sub.setAttribute("fill", "#6b7385");
    sub.textContent = "map v" + ring.map_version;
    svg.appendChild(sub);

    let about = ring.algorithm + " over " + ring.hash;
    if (ring.algorithm === "ring") about += ", " + ring.vnodes + " vnodes per unit of weight";
    if (ring.method === "sample") about += "; shares from " + fmt(ring.sample_keys) + " sample keys";
    if (ring.method === "ring-buckets") about += "; drawn in buckets (exact shares)";
    if (ring.overrides > 0) about += "; " + fmt(ring.overrides) + " pinned keys";
    $("ring-about").textContent = about;
    $("map-version").textContent = "map v" + ring.map_version;

    const tbody = $("ring-legend").querySelector("tbody");
    clear(tbody);
    ring.shards.forEach((s, i) => {
      const tr = el("tr", { "data-shard": s.name });
      const name = el("td");
      name.appendChild(el("span", { class: "chip", style: "background:" + color(i) }));
      name.appendChild(document.createTextNode(s.name + (s.state === "active" ? "" : " (" + s.state + ")")));
      tr.appendChild(name);
      tr.appendChild(el("td", { class: "num" }, s.weight));
      tr.appendChild(el("td", { class: "num", "data-col": "share" }, pct(s.share)));
      tr.appendChild(el("td", { class: "num" }, pct(s.ideal)));
      tr.appendChild(el("td", { class: "num" }, s.points === null ? "–" : fmt(s.points)));
      tbody.appendChild(tr);
    });
  }

  // -------------------------------------------------------------- rebalance
  function meanRate(from, to) {
    const xs = state.history.filter((h) => h.t >= from && h.t <= to);
    if (!xs.length) return null;
    return xs.reduce((a, h) => a + h.rate, 0) / xs.length;
  }

  function renderRebalance(admin, derived) {
    const now = Date.now();
    let phase = "idle", moved = 0, total = 0, error = null;
    const adminRunning = admin && (admin.phase === "pinning" || admin.phase === "moving");
    const derivedMoving = derived && derived.phase === "moving";
    if (adminRunning) {
      phase = admin.phase; moved = admin.keys_moved; total = admin.keys_to_move;
    } else if (derivedMoving) {
      phase = "moving"; moved = derived.keys_switched; total = derived.keys_switched + derived.keys_pinned;
    } else if (derived && derived.phase === "pending") {
      phase = "pending";
    } else if (admin && (admin.phase === "finished" || admin.phase === "failed")) {
      phase = admin.phase; moved = admin.keys_moved; total = admin.keys_to_move; error = admin.last_error;
    }
    if (adminRunning && derivedMoving) {
      // The stores may be a little ahead of the progress events.
      moved = Math.max(moved, derived.keys_switched);
      total = Math.max(total, derived.keys_switched + derived.keys_pinned);
    }
    const running = phase === "pinning" || phase === "moving";
    // The deployment's record of the run (whoever runs it): when, who,
    // how long, and whether it still reports.
    const run = $("rebalance-run");
    if (admin && admin.started_ms && admin.phase !== "idle") {
      let text = "started " + new Date(admin.started_ms).toLocaleTimeString() + (admin.runner ? " by " + admin.runner : "");
      if (admin.finished_ms) {
        text += ", " + admin.phase + " after " + ((admin.finished_ms - admin.started_ms) / 1000).toFixed(1) + " s";
      } else if (admin.updated_ms && now - admin.updated_ms > STALE_RUN_MS) {
        // Longer than a batch may wait for its runs in flight (the drain
        // timeout): the run has likely died.
        text += ", no word from it for " + Math.round((now - admin.updated_ms) / 1000) + " s (if it died, rerun `shardq rebalance`)";
      }
      run.textContent = text;
    } else {
      run.textContent = "–";
    }
    if (!running && state.rebalanceStart === null && admin && admin.started_ms && admin.finished_ms) {
      // A run that ended before this page opened: its figures still show.
      state.rebalanceStart = admin.started_ms;
      state.rebalanceEnd = admin.finished_ms;
      state.movedSeen = [];
    }
    const newRun = adminRunning && admin.started_ms && admin.started_ms !== state.rebalanceStart;
    if (running && (state.rebalanceStart === null || newRun)) {
      state.rebalanceStart = admin && adminRunning && admin.started_ms ? admin.started_ms : now;
      state.movedSeen = [];
    }
    if (!running && state.rebalanceStart !== null && phase !== "pending" && state.rebalanceEnd === null) {
      state.rebalanceEnd = admin && admin.finished_ms ? admin.finished_ms : now;
    }
    if (running) state.rebalanceEnd = null;
    const p = $("rebalance-phase");
    p.textContent = phase;
    p.className = "phase " + phase;
    $("rebalance-moved").textContent = fmt(moved);
    $("rebalance-total").textContent = fmt(total);
    $("rebalance-jobs").textContent = fmt(admin && admin.jobs_moved ? admin.jobs_moved : 0);
    $("rebalance-bar").style.width = total > 0 ? (100 * Math.min(1, moved / total)).toFixed(1) + "%" : (phase === "finished" ? "100%" : "0");
    let versions = derived ? "published v" + derived.published_version : "";
    if (derived && derived.target_version !== null) versions += ", a target is recorded";
    if (admin && admin.from_version !== null && admin.to_version !== null) versions += " (last run v" + admin.from_version + " → v" + admin.to_version + ")";
    $("rebalance-versions").textContent = versions;
    const ul = $("paused-list");
    clear(ul);
    if (derived) {
      let longest = 0;
      for (const k of derived.paused) longest = Math.max(longest, k.paused_ms);
      $("rebalance-paused").textContent = derived.paused_total === 0
        ? "none"
        : fmt(derived.paused_total) + (derived.paused_total === 1 ? " key" : " keys") + ", longest " + (longest / 1000).toFixed(1) + " s so far";
      for (const k of derived.paused.slice(0, 8)) {
        ul.appendChild(el("li", null, k.key + " on " + k.shard + ": paused " + (k.paused_ms / 1000).toFixed(1) + " s"));
      }
    }
    // Backlog change before (the 10 s before it started) and during.
    if (state.rebalanceStart !== null) {
      const start = state.rebalanceStart;
      const end = state.rebalanceEnd || now;
      const before = meanRate(start - 10000, start);
      const during = meanRate(start, end);
      $("rebalance-rates").textContent = "before " + fmtRate(before) + ", during " + fmtRate(during);
      if (running) state.movedSeen.push({ t: now, moved });
      const first = state.movedSeen[0], last = state.movedSeen[state.movedSeen.length - 1];
      if (first && last && last.t > first.t) {
        const rate = (last.moved - first.moved) / ((last.t - first.t) / 1000);
        let speed = rate.toFixed(1) + " keys/s";
        // Time left at that rate, while it runs.
        if (running && rate > 0 && total > moved) {
          speed += ", about " + Math.ceil((total - moved) / rate) + " s left";
        } else if (running && total > moved) {
          speed += " (no key switched yet: waiting for the batch's runs in flight, or copying its backlogs)";
        }
        $("rebalance-speed").textContent = speed;
      }
    } else {
      const recent = meanRate(now - 10000, now);
      $("rebalance-rates").textContent = "now " + fmtRate(recent) + " (no rebalance seen yet)";
      $("rebalance-speed").textContent = "–";
    }
    // Keys a move still pins to their old shards do not follow the arcs.
    const pin = $("ring-pinned");
    const nPinned = derived ? derived.keys_pinned : 0;
    pin.hidden = nPinned === 0;
    if (nPinned > 0) {
      const some = derived.pinned.slice(0, 5).map((k) => k.key + " → " + k.shard).join(", ");
      pin.textContent = fmt(nPinned) + (nPinned === 1 ? " key is" : " keys are") + " still pinned to the old shard while it moves, against the arcs: " + some + (nPinned > 5 ? ", …" : "");
    } else {
      pin.textContent = "";
    }
    const e = $("rebalance-error");
    e.hidden = !error;
    e.textContent = error ? "last rebalance failed: " + error : "";
  }

  // ------------------------------------------------------------------- hot
  function renderHot(hot) {
    const box = $("hot");
    clear(box);
    for (const s of hot.shards) {
      const div = el("div", { "data-shard": s.shard });
      div.appendChild(el("h3", null, s.shard + " · " + (s.error ? "unreadable" : fmt(s.keys_with_work) + " keys with work")));
      if (s.error) { div.appendChild(el("p", { class: "error small" }, s.error)); }
      const ol = el("ol");
      for (const k of s.top) {
        ol.appendChild(el("li", null, k.key + " — " + fmt(k.depth) + " queued" + (k.in_flight ? ", 1 in flight" : "") + (k.dead ? ", " + k.dead + " dead" : "")));
      }
      div.appendChild(ol);
      box.appendChild(div);
    }
  }

  // ------------------------------------------------------------------ flow
  // Starts per second per group, from two polls of this server's counts.
  function renderFlow(flow) {
    const body = $("flow-groups").querySelector("tbody");
    clear(body);
    const groups = (flow && flow.groups) || {};
    const names = Object.keys(groups);
    $("flow-empty").hidden = names.length > 0;
    const prev = state.flowPrev;
    const now = flow ? flow.now_ms : Date.now();
    for (const name of names) {
      const g = groups[name];
      let rate = null;
      if (prev && prev.groups[name] && now > prev.now_ms) {
        rate = (g.starts - prev.groups[name].starts) * 1000 / (now - prev.now_ms);
      }
      // A group with a rate is loaded by its starts; one with only a
      // concurrency by its runs at once.
      let load = 0;
      if (g.per_second != null) load = rate === null ? 0 : Math.min(rate / g.per_second, 1);
      else if (g.concurrency != null && g.running != null) load = Math.min(g.running / g.concurrency, 1);
      const bar = el("div", { class: "bar" });
      bar.appendChild(el("span", { style: "width:" + (load * 100).toFixed(0) + "%;background:" + (load > 0.95 ? "#c0392b" : "#2e86de") }));
      const held = g.held_until_ms && g.held_until_ms > now;
      const tr = el("tr", { "data-group": name });
      tr.appendChild(el("td", null, name));
      tr.appendChild(el("td", { class: "num" }, rate === null ? "…" : rate.toFixed(1)));
      const limit = g.rate == null ? "none" : g.rate + " (burst " + fmt(g.burst) + ")";
      tr.appendChild(el("td", { class: "num" }, limit));
      let runs = "no limit";
      if (g.concurrency != null) runs = (g.running == null ? "?" : fmt(g.running)) + " of " + fmt(g.concurrency);
      tr.appendChild(el("td", { class: "num runs" }, runs));
      const cell = el("td");
      cell.appendChild(bar);
      tr.appendChild(cell);
      tr.appendChild(el("td", { class: "num" }, fmt(g.throttled)));
      tr.appendChild(el("td", null, held ? "held " + ((g.held_until_ms - now) / 1000).toFixed(1) + " s" : "open"));
      body.appendChild(tr);
    }
    state.flowPrev = flow ? { now_ms: now, groups: groups } : null;
    const keys = (flow && flow.held_keys) || [];
    const t = $("flow-held");
    t.hidden = keys.length === 0;
    const kb = t.querySelector("tbody");
    clear(kb);
    for (const k of keys.slice(0, 50)) {
      const tr = el("tr", { "data-key": k.key });
      tr.appendChild(el("td", null, k.key));
      tr.appendChild(el("td", null, k.by));
      tr.appendChild(el("td", { class: "num" }, Math.max(0, (k.until_ms - now) / 1000).toFixed(1) + " s"));
      kb.appendChild(tr);
    }
  }

  // ------------------------------------------------------------- schedules
  function whenText(w) {
    if (w.cron) return "cron " + w.cron.expr + " (" + w.cron.tz + ")";
    if (w.every) return "every " + fmtMs(w.every.every_ms);
    return "?";
  }

  function fmtMs(ms) {
    if (ms % 86400000 === 0) return (ms / 86400000) + " d";
    if (ms % 3600000 === 0) return (ms / 3600000) + " h";
    if (ms % 60000 === 0) return (ms / 60000) + " min";
    return (ms / 1000) + " s";
  }

  function when(ms) { return new Date(ms).toISOString().replace(".000Z", "Z"); }

  function scheduleNote(kind, text) {
    const m = $("schedules-msg");
    m.hidden = !text;
    m.className = "note " + kind;
    m.textContent = text || "";
  }

  async function scheduleAction(id, action, button) {
    button.disabled = true;
    try {
      const r = await api("POST", "/v1/schedules/" + encodeURIComponent(id) + "/" + action, {});
      const what = action === "trigger" ? "triggered: job " + r.job : action + "d";
      scheduleNote("ok", "Schedule " + id + " " + what + ".");
      refreshSchedules();
    } catch (e) {
      scheduleNote("error", authMessage(e) || (action + " failed: " + e.message));
    } finally {
      button.disabled = false;
    }
  }

  function renderSchedules(list) {
    const body = $("schedules").querySelector("tbody");
    clear(body);
    const all = (list && list.schedules) || [];
    $("schedules-empty").hidden = all.length > 0;
    for (const s of all) {
      const tr = el("tr", { "data-schedule": s.id });
      tr.appendChild(el("td", null, s.id));
      tr.appendChild(el("td", null, s.key));
      tr.appendChild(el("td", null, whenText(s.when) + " · overlap " + s.overlap));
      let next = "ended";
      if (s.paused) next = "paused";
      else if (s.next_fire_ms != null) next = when(s.next_fire_ms);
      tr.appendChild(el("td", { class: s.paused ? "muted" : "" }, next));
      const last = s.state.last;
      const lastCell = el("td");
      if (last) {
        lastCell.appendChild(document.createTextNode(when(last.tick_ms) + " → "));
        lastCell.appendChild(jobLink(last.shard + ":" + last.job));
      } else {
        lastCell.textContent = "never";
      }
      tr.appendChild(lastCell);
      tr.appendChild(el("td", { class: "num" }, fmt(s.state.fired)));
      tr.appendChild(el("td", { class: "num" }, fmt(s.state.skipped)));
      tr.appendChild(el("td", { class: "num" + (s.state.missed ? " error" : "") }, fmt(s.state.missed)));
      const actions = el("td");
      const toggle = el("button", { type: "button", class: s.paused ? "resume" : "pause" }, s.paused ? "Resume" : "Pause");
      toggle.addEventListener("click", () => scheduleAction(s.id, s.paused ? "resume" : "pause", toggle));
      const trigger = el("button", { type: "button", class: "trigger" }, "Run now");
      trigger.addEventListener("click", () => scheduleAction(s.id, "trigger", trigger));
      actions.appendChild(toggle);
      actions.appendChild(trigger);
      tr.appendChild(actions);
      body.appendChild(tr);
    }
  }

  async function refreshSchedules() {
    try { renderSchedules(await api("GET", "/v1/schedules")); } catch (e) { /* shown by the poll */ }
  }

  // ------------------------------------------------------------------ dead
  function deadNote(kind, text) {
    const m = $("dead-msg");
    m.hidden = !text;
    m.className = "note " + kind;
    m.textContent = text || "";
  }

  async function deadAction(kind, id, button) {
    if (kind === "purge" && state.deadArmed !== id) {
      state.deadArmed = id;
      button.textContent = "Confirm purge";
      return;
    }
    state.deadArmed = null;
    try {
      const r = await api("POST", "/v1/dead/" + kind, { ids: [id] });
      const n = kind === "retry" ? r.retried : r.purged;
      deadNote("ok", (kind === "retry" ? "Retried " : "Purged ") + n + " job" + (n === 1 ? "" : "s") + " (" + id + ").");
      refreshDead();
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        deadNote("bad", "Refused (" + e.status + "): " + kind + " needs a token with the admin role. " + e.message);
      } else {
        deadNote("bad", kind + " of " + id + " failed: " + e.message);
      }
    }
  }

  // Every dead letter of every shard, after a second click naming how many.
  async function deadAll(kind, button) {
    const armed = kind + ":all";
    if (state.deadArmed !== armed) {
      let n = "every";
      try {
        const st = await api("GET", "/v1/status");
        n = fmt(st.totals.dead);
      } catch (e) { /* the count is only for the label */ }
      state.deadArmed = armed;
      button.textContent = "Confirm: " + kind + " " + n;
      return;
    }
    state.deadArmed = null;
    button.textContent = kind === "retry" ? "Retry all" : "Purge all";
    try {
      const r = await api("POST", "/v1/dead/" + kind, { all: true });
      const n = kind === "retry" ? r.retried : r.purged;
      deadNote("ok", (kind === "retry" ? "Retried " : "Purged ") + n + " dead job" + (n === 1 ? "" : "s") + ".");
      refreshDead();
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        deadNote("bad", "Refused (" + e.status + "): " + kind + " needs a token with the admin role. " + e.message);
      } else {
        deadNote("bad", kind + " of every dead letter failed: " + e.message);
      }
    }
  }

  function renderDead(d) {
    const tbody = $("dead").querySelector("tbody");
    clear(tbody);
    $("dead-empty").hidden = d.dead.length > 0;
    for (const j of d.dead) {
      const tr = el("tr", { "data-job": j.id });
      const idCell = el("td");
      idCell.appendChild(jobLink(j.id));
      tr.appendChild(idCell);
      tr.appendChild(el("td", null, j.shard));
      tr.appendChild(el("td", null, j.key));
      tr.appendChild(el("td", { class: "num" }, j.attempts));
      tr.appendChild(el("td", null, j.reason || ""));
      const td = el("td");
      const retry = el("button", { type: "button", class: "retry" }, "Retry");
      retry.addEventListener("click", () => deadAction("retry", j.id, retry));
      const purge = el("button", { type: "button", class: "purge danger" }, state.deadArmed === j.id ? "Confirm purge" : "Purge");
      purge.addEventListener("click", () => deadAction("purge", j.id, purge));
      td.appendChild(retry);
      td.appendChild(document.createTextNode(" "));
      td.appendChild(purge);
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
  }

  async function refreshDead() {
    try { renderDead(await api("GET", "/v1/dead?limit=20")); } catch (e) { /* shown by the poll */ }
  }

  // -------------------------------------------------------------------- key
  async function lookup(ev) {
    ev.preventDefault();
    const key = $("key-input").value;
    keyNote("", "");
    const err = $("key-error");
    const out = $("key-result");
    if (!key) { err.hidden = false; err.textContent = "Type a key first."; out.hidden = true; return; }
    try {
      const k = await api("GET", "/v1/keys/" + encodeURIComponent(key));
      err.hidden = true;
      out.hidden = false;
      $("key-shard").textContent = k.shard;
      $("key-computed").textContent = k.computed;
      $("key-override").textContent = k.override === null ? "none" : "pinned to " + k.override;
      $("key-depth").textContent = fmt(k.depth);
      $("key-inflight").textContent = fmt(k.in_flight);
      $("key-dead").textContent = fmt(k.dead);
      $("key-owned").textContent = k.owned_here ? "yes" : "no";
      $("key-version").textContent = "v" + k.map_version;
      showBackOff(k);
      await lookupJobs(key);
    } catch (e) {
      out.hidden = true;
      err.hidden = false;
      err.textContent = authMessage(e) || ("Lookup failed: " + e.message);
    }
  }

  // A handler's back-off holding the key (a wait `key resume` lifts).
  function showBackOff(k) {
    state.key = k.key;
    const b = k.back_off;
    const dd = $("key-backoff");
    dd.setAttribute("data-held", b ? "yes" : "no");
    dd.textContent = b ? "held until " + new Date(b.until_ms).toLocaleTimeString() + " (" + ago(b.until_ms) + "): " + b.jobs.join(", ") : "none";
    $("key-resume").hidden = !b;
  }

  function keyNote(kind, text) {
    const m = $("key-msg");
    m.hidden = !text;
    m.className = "note " + kind;
    m.textContent = text || "";
  }

  async function resumeKey() {
    const key = state.key;
    if (key === null) return;
    try {
      const r = await api("POST", "/v1/keys/" + encodeURIComponent(key) + "/resume", {});
      keyNote("ok", r.resumed
        ? "Resumed " + key + ": " + r.back_off.jobs.join(", ") + " due now."
        : "No back-off holds " + key + " now: nothing changed.");
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        keyNote("bad", "Refused (" + e.status + "): resume needs a token with the admin role. " + e.message);
      } else {
        keyNote("bad", "Resume of " + key + " refused: " + e.message);
      }
      return;
    }
    try { showBackOff(await api("GET", "/v1/keys/" + encodeURIComponent(key))); } catch (e) { /* the lookup shows errors */ }
    await lookupJobs(key);
  }

  // --------------------------------------------------------------- history
  const SVG_NS = "http://www.w3.org/2000/svg";
  function renderHistory(h) {
    $("flow-acked").textContent = fmt(h.totals.acked);
    $("flow-failed").textContent = fmt(h.totals.failed);
    $("flow-enqueued").textContent = fmt(h.totals.enqueued);
    const last = (a) => a.slice(-60).reduce((x, y) => x + y, 0);
    $("flow-minute").textContent = fmt(last(h.acked)) + " acked, " + fmt(last(h.failed)) + " failed";
    // The last minute's waits: mean over its claims, and the longest.
    const claims = h.claimed.slice(-60), means = h.wait_mean_ms.slice(-60), maxes = h.wait_max_ms.slice(-60);
    const n60 = claims.reduce((x, y) => x + y, 0);
    const mean = n60 ? claims.reduce((acc, c, i) => acc + c * means[i], 0) / n60 : null;
    $("flow-wait").textContent = n60 ? "mean " + fmt(Math.round(mean)) + " ms, longest " + fmt(Math.max(...maxes)) + " ms (" + fmt(n60) + " starts)" : "no starts";
    const svg = $("flow");
    clear(svg);
    const n = h.acked.length;
    const top = Math.max(1, ...h.acked, ...h.failed, ...h.enqueued);
    const W = 720, H = 140;
    const line = (series, cls, color) => {
      const pts = series.map((v, i) => (i * W / Math.max(1, n - 1)).toFixed(1) + "," + (H - 2 - v * (H - 4) / top).toFixed(1));
      const p = document.createElementNS(SVG_NS, "polyline");
      p.setAttribute("points", pts.join(" "));
      p.setAttribute("fill", "none");
      p.setAttribute("stroke", color);
      p.setAttribute("stroke-width", "1.5");
      p.setAttribute("vector-effect", "non-scaling-stroke");
      p.setAttribute("class", cls);
      svg.appendChild(p);
    };
    line(h.enqueued, "enq", "#1565c0");
    line(h.acked, "acked", "#2e7d32");
    line(h.failed, "failed", "#c62828");
    $("flow-scale").textContent = "· top of the chart: " + fmt(top) + "/s · " + Math.round(n / 60) + " min shown";
  }

  function pickFlow(seconds) {
    state.flowSeconds = seconds;
    $("flow-600").className = seconds === 600 ? "picked" : "";
    $("flow-3600").className = seconds === 3600 ? "picked" : "";
    api("GET", "/v1/history?seconds=" + seconds).then(renderHistory, () => {});
  }

  // -------------------------------------------------------------------- job
  function ago(ms) {
    if (!ms) return "–";
    const d = (Date.now() - ms) / 1000;
    const n = Math.abs(d) < 10 ? Math.abs(d).toFixed(1) : Math.round(Math.abs(d)).toString();
    return d >= 0 ? n + " s ago" : "in " + n + " s";
  }
  const PAYLOAD_SHOWN = 2048;

  function jobLink(id) {
    const a = el("a", { href: "#job", class: "job-link" }, id);
    a.addEventListener("click", (ev) => { ev.preventDefault(); $("job-input").value = id; showJob(id); });
    return a;
  }

  function jobNote(kind, text) {
    const m = $("job-msg");
    m.hidden = !text;
    m.className = "note " + kind;
    m.textContent = text || "";
  }

  // A dependent (@N) as a small graph: its dependencies on the left, each
  // coloured by its outcome, and arrows to it on the right.
  const GRAPH_NODES = 24;
  function renderDependent(j) {
    const box = $("job-graph");
    const svg = $("job-graph-svg");
    box.hidden = false;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const NS = "http://www.w3.org/2000/svg";
    const node = (x, y, w, label, cls, data) => {
      const g = document.createElementNS(NS, "g");
      g.setAttribute("class", cls);
      for (const [k, v] of Object.entries(data)) g.setAttribute(k, v);
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", x); r.setAttribute("y", y); r.setAttribute("width", w); r.setAttribute("height", 18);
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", x + 5); t.setAttribute("y", y + 13);
      t.textContent = label;
      g.appendChild(r); g.appendChild(t);
      svg.appendChild(g);
    };
    const shown = j.after.slice(0, GRAPH_NODES);
    const rows = Math.max(shown.length, 1);
    const height = rows * 24 + 6;
    svg.setAttribute("viewBox", "0 0 520 " + height);
    svg.setAttribute("height", String(Math.min(height, 600)));
    const mid = height / 2 - 9;
    shown.forEach((d, i) => {
      const y = 3 + i * 24;
      const outcome = d.outcome || "pending";
      const line = document.createElementNS(NS, "line");
      line.setAttribute("x1", 230); line.setAttribute("y1", y + 9);
      line.setAttribute("x2", 330); line.setAttribute("y2", mid + 9);
      svg.appendChild(line);
      node(4, y, 226, d.id + " · " + outcome, "node-" + outcome, { "data-dep": d.id, "data-outcome": outcome });
    });
    node(330, mid, 186, j.id + " · " + j.state, "node-" + j.state, { "data-dependent": j.id, "data-state": j.state });
    const left = j.after.filter((d) => !d.outcome).length;
    $("job-graph-note").textContent = j.after.length + " dependencies, " + left + " not ended" +
      (j.after.length > GRAPH_NODES ? " (the first " + GRAPH_NODES + " drawn)" : "") +
      "; on a dependency that did not complete: " + j.on_dependency_failure;
  }

  // A batch (@N): its progress as one bar (completed, dead, other,
  // pending), then its callbacks, each fired or not.
  function renderBatch(b) {
    const box = $("job-graph");
    const svg = $("job-graph-svg");
    box.hidden = false;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const NS = "http://www.w3.org/2000/svg";
    const c = b.counts;
    const kinds = Object.keys(b.callbacks);
    const height = 34 + kinds.length * 24;
    svg.setAttribute("viewBox", "0 0 520 " + height);
    svg.setAttribute("height", String(height));
    const total = Math.max(c.jobs, 1);
    let x = 4;
    for (const [part, n] of [["completed", c.completed], ["dead", c.dead], ["cancelled", c.other], ["pending", c.pending]]) {
      if (!n) continue;
      const w = 512 * n / total;
      const g = document.createElementNS(NS, "g");
      g.setAttribute("class", "node-" + part);
      g.setAttribute("data-part", part);
      g.setAttribute("data-count", String(n));
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", x); r.setAttribute("y", 4); r.setAttribute("width", w); r.setAttribute("height", 18);
      g.appendChild(r);
      svg.appendChild(g);
      x += w;
    }
    kinds.forEach((k, i) => {
      const cb = b.callbacks[k];
      const state = cb.fired ? "released" : (cb.refused ? "failed" : (b.state === "complete" ? "cancelled" : "waiting"));
      const g = document.createElementNS(NS, "g");
      g.setAttribute("class", "node-" + state);
      g.setAttribute("data-callback", k);
      g.setAttribute("data-fired", cb.fired ? "yes" : "no");
      const y = 30 + i * 24;
      const r = document.createElementNS(NS, "rect");
      r.setAttribute("x", 4); r.setAttribute("y", y); r.setAttribute("width", 512); r.setAttribute("height", 18);
      const t = document.createElementNS(NS, "text");
      t.setAttribute("x", 9); t.setAttribute("y", y + 13);
      t.textContent = "on " + k + ": " + (cb.fired ? "fired as " + cb.fired
        : cb.refused ? "refused for good: " + cb.refused
        : (b.state === "complete" ? "did not fire" : "not yet"));
      g.appendChild(r); g.appendChild(t);
      svg.appendChild(g);
    });
    $("job-graph-note").textContent = "Batch " + b.state + ": " + fmt(c.jobs) + " jobs, " + fmt(c.completed) + " completed, " +
      fmt(c.dead) + " dead, " + fmt(c.other) + " cancelled or forgotten, " + fmt(c.pending) + " not ended";
  }

  async function showJob(id) {
    const err = $("job-error");
    const out = $("job-result");
    const cancel = $("job-cancel");
    state.cancelArmed = null;
    cancel.textContent = "Cancel job";
    $("job-graph").hidden = true;
    try {
      const j = await api("GET", "/v1/jobs/" + encodeURIComponent(id));
      state.job = j;
      err.hidden = true;
      out.hidden = false;
      if (j.counts !== undefined) {
        // A batch: its progress and callbacks.
        $("job-id").textContent = j.id;
        $("job-key").textContent = j.key + " (its callbacks' key)";
        $("job-state").textContent = j.state;
        $("job-attempts").textContent = "–";
        $("job-starts").textContent = "–";
        $("job-created").textContent = ago(j.created_ms);
        $("job-due").textContent = "–";
        $("job-run").textContent = "–";
        $("job-reason").textContent = "–";
        $("job-payload").textContent = "–";
        cancel.hidden = true;
        renderBatch(j);
        return;
      }
      if (j.after !== undefined) {
        // A dependent: what it waits for, and the job it became.
        $("job-id").textContent = j.id;
        $("job-key").textContent = j.key;
        $("job-state").textContent = j.state + (j.released ? " as " + j.released : "");
        $("job-attempts").textContent = j.job ? String(j.job.attempts) : "–";
        $("job-starts").textContent = "–";
        $("job-created").textContent = ago(j.created_ms);
        $("job-due").textContent = "–";
        $("job-run").textContent = "–";
        $("job-reason").textContent = j.reason || "–";
        const text = j.payload !== null && j.payload !== undefined ? j.payload : "(base64: not UTF-8)";
        $("job-payload").textContent = text.length > PAYLOAD_SHOWN ? text.slice(0, PAYLOAD_SHOWN) + "…" : text;
        cancel.hidden = j.state !== "waiting";
        renderDependent(j);
        return;
      }
      $("job-id").textContent = j.id;
      $("job-key").textContent = j.key;
      // A finished or cancelled job (kept by the retention) has an outcome
      // and no live fields.
      const done = j.outcome !== undefined;
      $("job-state").textContent = done ? j.outcome + " (finished " + ago(j.finished_ms) + ")" : j.state;
      $("job-attempts").textContent = done ? String(j.attempts) : j.attempts + " of " + j.max_attempts + (j.state === "running" ? " (attempt " + (j.attempts + 1) + " running)" : "");
      const starts = j.attempt_starts_ms || [];
      $("job-starts").textContent = starts.length ? starts.map(ago).join(", ") : "–";
      $("job-created").textContent = done ? "–" : ago(j.created_ms);
      $("job-due").textContent = (j.state === "queued" || j.state === "delayed") ? ago(j.not_before_ms) : "–";
      $("job-run").textContent = j.run ? "fence " + j.run.fence + (j.run.lease_expires_ms ? ", job lease ends " + ago(j.run.lease_expires_ms) : "") : "–";
      $("job-reason").textContent = j.reason || "–";
      const text = done ? "(not kept once finished)" : j.payload !== undefined ? j.payload : "(" + j.payload_b64.length + " characters of base64: not UTF-8)";
      $("job-payload").textContent = text.length > PAYLOAD_SHOWN ? text.slice(0, PAYLOAD_SHOWN) + "… (" + text.length + " characters)" : text;
      cancel.hidden = done;
      cancel.textContent = j.state === "running" ? "Stop and cancel" : "Cancel job";
    } catch (e) {
      state.job = null;
      out.hidden = true;
      cancel.hidden = true;
      err.hidden = false;
      err.textContent = authMessage(e) || (e.status === 404 ? "Not live: " + e.message : "Reading the job failed: " + e.message);
    }
  }

  async function cancelJob(id, button, after) {
    if (state.cancelArmed !== id) {
      state.cancelArmed = id;
      button.textContent = "Confirm cancel";
      return;
    }
    state.cancelArmed = null;
    try {
      const r = await api("DELETE", "/v1/jobs/" + encodeURIComponent(id), {});
      jobNote("ok", r.stopping
        ? "Cancelled " + id + ": its run is asked to stop, and the job goes when the run ends (at the latest when its job lease lapses)."
        : "Cancelled " + id + ": it will not run.");
    } catch (e) {
      if (e.status === 401 || e.status === 403) {
        jobNote("bad", "Refused (" + e.status + "): cancel needs a token with the admin role. " + e.message);
      } else {
        jobNote("bad", "Cancel of " + id + " refused: " + e.message);
      }
    }
    if (after) after();
  }

  function renderKeyJobs(list) {
    const table = $("key-jobs");
    const tbody = table.querySelector("tbody");
    clear(tbody);
    table.hidden = list.jobs.length === 0;
    $("key-jobs-empty").hidden = list.jobs.length > 0;
    for (const j of list.jobs) {
      const tr = el("tr", { "data-job": j.id, "data-state": j.state });
      const id = el("td");
      id.appendChild(jobLink(j.id));
      tr.appendChild(id);
      tr.appendChild(el("td", null, j.state));
      tr.appendChild(el("td", { class: "num" }, j.attempts + "/" + j.max_attempts));
      tr.appendChild(el("td", null, j.reason || ""));
      const td = el("td");
      const label = j.state === "running" ? "Stop and cancel" : "Cancel";
      const b = el("button", { type: "button", class: "cancel danger" }, state.cancelArmed === j.id ? "Confirm cancel" : label);
      b.addEventListener("click", () => cancelJob(j.id, b, () => lookupJobs(list.key)));
      td.appendChild(b);
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
    // What became of the key's finished jobs, as far as the retention keeps them.
    const finishedTable = $("key-finished");
    const rbody = finishedTable.querySelector("tbody");
    clear(rbody);
    const finished = list.finished || [];
    finishedTable.hidden = finished.length === 0;
    for (const f of finished) {
      const tr = el("tr", { "data-job": f.id, "data-outcome": f.outcome });
      tr.appendChild(el("td", null, f.id));
      tr.appendChild(el("td", null, f.outcome));
      tr.appendChild(el("td", { class: "num" }, String(f.attempts)));
      tr.appendChild(el("td", null, ago(f.finished_ms)));
      tr.appendChild(el("td", null, f.reason || ""));
      rbody.appendChild(tr);
    }
  }

  async function lookupJobs(key) {
    try { renderKeyJobs(await api("GET", "/v1/keys/" + encodeURIComponent(key) + "/jobs?limit=50&finished=20")); } catch (e) { /* the lookup shows errors */ }
  }

  // The keys with work starting with what was typed; each looks itself up.
  async function searchKeys() {
    const prefix = $("key-input").value;
    const list = $("key-matches");
    const err = $("key-error");
    clear(list);
    try {
      const r = await api("GET", "/v1/keys?prefix=" + encodeURIComponent(prefix) + "&limit=50");
      err.hidden = true;
      list.hidden = false;
      if (r.keys.length === 0) list.appendChild(el("li", { class: "muted" }, "No key with work starts with " + JSON.stringify(prefix) + "."));
      for (const k of r.keys) {
        const li = el("li", { "data-key": k.key });
        const a = el("a", { href: "#key", class: "key-link" }, k.key);
        a.addEventListener("click", (ev) => { ev.preventDefault(); $("key-input").value = k.key; $("key-go").click(); });
        li.appendChild(a);
        li.appendChild(document.createTextNode(" on " + k.shard + ": " + fmt(k.depth) + " queued" + (k.in_flight ? ", 1 in flight" : "") + (k.dead ? ", " + k.dead + " dead" : "")));
        list.appendChild(li);
      }
      if (r.more) list.appendChild(el("li", { class: "muted" }, "… more keys match: type more of the key."));
      for (const f of r.failed) list.appendChild(el("li", { class: "error" }, f.shard + " could not be read: " + f.error));
    } catch (e) {
      list.hidden = true;
      err.hidden = false;
      err.textContent = authMessage(e) || ("Search failed: " + e.message);
    }
  }

  // ----------------------------------------------------------------- outbox
  // The Postgres outbox, when the server was started with --outbox-postgres.
  function renderOutbox(o) {
    const panel = $("outbox-panel");
    panel.hidden = !o;
    if (!o) return;
    const err = $("outbox-error");
    err.hidden = !o.error;
    err.textContent = o.error ? "Cannot read the outbox: " + o.error : "";
    if (o.error) return;
    $("outbox-depth").textContent = String(o.depth);
    $("outbox-lag").textContent = o.oldest_age_ms == null ? "empty" : (o.oldest_age_ms / 1000).toFixed(1) + " s";
    const relay = $("outbox-relay");
    relay.textContent = o.relay_active ? "active" : "none active: rows wait";
    relay.className = o.relay_active ? "" : "bad";
    $("outbox-open").textContent = String(o.open_transactions);
    $("outbox-dead").textContent = String(o.dead_tuples);
  }

  // Dependents of the deployment, when it has had any.
  function renderDependentsLine(t) {
    const p = $("dependents-line");
    p.hidden = !t || (t.waiting + t.released + t.failed + (t.batches || 0) + (t.callbacks_fired || 0) === 0);
    if (p.hidden) return;
    p.textContent = "Dependents: " + fmt(t.waiting) + " waiting for their dependencies; " + fmt(t.released) +
      " released and " + fmt(t.failed) + " failed so far. Batches: " + fmt(t.batches) + " not yet complete, " +
      fmt(t.batch_jobs_released || 0) + " of their jobs released; " +
      fmt(t.callbacks_fired) + " callbacks fired (show one by its @N id under Job).";
  }

  // ----------------------------------------------------------------- server
  // This server's load against its bounds (the shardq_http_* gauges).
  function renderServer(s) {
    const panel = $("server-panel");
    panel.hidden = !s;
    if (!s) return;
    const mib = (b) => (b / 1048576).toFixed(1) + " MiB";
    const refused = s.connections_refused ? " (" + fmt(s.connections_refused) + " refused since the start)" : "";
    $("server-connections").textContent = fmt(s.connections_open) + refused;
    $("server-requests").textContent = fmt(s.requests_in_service) + " of " + fmt(s.requests_max);
    $("server-polls").textContent = fmt(s.polls_in_service) + " of " + fmt(s.polls_max) + ", " + fmt(s.polls_waiting) + " waiting";
    $("server-bodies").textContent = mib(s.body_bytes_reading) + " of " + mib(s.body_bytes_max);
  }

  // ------------------------------------------------------------------- poll
  async function poll() {
    const slow = Date.now() - state.lastSlow >= SLOW_MS || !state.ringIndex.length;
    if (slow) state.lastSlow = Date.now();
    const jobs = {
      status: api("GET", "/v1/status"),
      admin: api("GET", "/v1/admin/rebalance"),
      reshard: api("GET", "/v1/reshard"),
    };
    if (slow) {
      jobs.history = api("GET", "/v1/history?seconds=" + state.flowSeconds);
      jobs.ring = api("GET", "/v1/ring");
      jobs.hot = api("GET", "/v1/hot?top=10");
      jobs.dead = api("GET", "/v1/dead?limit=20");
      jobs.schedules = api("GET", "/v1/schedules");
    }
    const names = Object.keys(jobs);
    const results = await Promise.allSettled(names.map((n) => jobs[n]));
    const got = {};
    let problem = null;
    names.forEach((n, i) => {
      if (results[i].status === "fulfilled") got[n] = results[i].value;
      else if (!problem) problem = results[i].reason;
    });
    // The ring first: it names each shard's state and weight.
    if (got.ring) renderRing(got.ring);
    if (got.status) renderShards(got.status);
    if (got.status) renderFlow(got.status.flow);
    if (got.status) renderOutbox(got.status.outbox || null);
    if (got.status) renderServer(got.status.server || null);
    if (got.status) renderDependentsLine(got.status.dependents || null);
    if (got.admin || got.reshard) renderRebalance(got.admin || null, got.reshard || null);
    if (got.hot) renderHot(got.hot);
    if (got.dead) renderDead(got.dead);
    if (got.schedules) renderSchedules(got.schedules);
    if (got.history) renderHistory(got.history);
    if (problem) {
      setConn(false, authMessage(problem) || ("Reading failed: " + problem.message));
    } else {
      setConn(true);
    }
  }

  async function loop() {
    const started = Date.now();
    try { await poll(); } catch (e) { setConn(false, "Dashboard error: " + e.message); }
    // Polls start at least POLL_MS apart, however long one takes.
    setTimeout(loop, Math.max(POLL_MS - (Date.now() - started), 0));
  }

  // -------------------------------------------------------------------- init
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    setToken($("token-input").value.trim());
    $("token-input").value = "";
    state.lastSlow = 0;
    poll();
  });
  $("token-clear").addEventListener("click", () => { setToken(""); poll(); });
  $("key-form").addEventListener("submit", lookup);
  $("key-search").addEventListener("click", searchKeys);
  $("key-resume").addEventListener("click", resumeKey);
  $("dead-retry-all").addEventListener("click", () => deadAll("retry", $("dead-retry-all")));
  $("dead-purge-all").addEventListener("click", () => deadAll("purge", $("dead-purge-all")));
  $("flow-600").addEventListener("click", () => pickFlow(600));
  $("flow-3600").addEventListener("click", () => pickFlow(3600));
  $("job-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("job-input").value.trim();
    jobNote("", "");
    if (!id) { $("job-error").hidden = false; $("job-error").textContent = "Type a job id (SHARD:ID) first."; return; }
    showJob(id);
  });
  $("job-cancel").addEventListener("click", () => {
    const j = state.job;
    if (j) cancelJob(j.id, $("job-cancel"), () => showJob(j.id));
  });
  showTokenState();
  loop();
})();
