"""The live dashboard: one self-contained HTML page that polls the engine's live stats."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse

# The page may load nothing but itself and talk to nothing but its own origin.
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
NO_STORE = {"Cache-Control": "no-store"}

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>segkv dashboard</title>
<style>
:root { --bg:#0f1419; --card:#1a2129; --fg:#e6e6e6; --dim:#8a96a3; --acc:#4fc3f7; --warn:#ffb74d; }
* { box-sizing: border-box; }
body { margin:0; padding:16px; background:var(--bg); color:var(--fg);
       font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display:flex; align-items:baseline; gap:12px; margin-bottom:12px; }
h1 { font-size:18px; margin:0; } h2 { font-size:13px; margin:0 0 8px; color:var(--dim);
     text-transform:uppercase; letter-spacing:.05em; font-weight:600; }
#status { color:var(--dim); font-size:12px; } #status.offline { color:var(--warn); }
.grid { display:grid; grid-template-columns:repeat(auto-fit, minmax(240px, 1fr)); gap:12px; }
.card { background:var(--card); border-radius:8px; padding:12px 14px; }
.big { font-size:28px; font-variant-numeric:tabular-nums; }
.unit { color:var(--dim); font-size:12px; margin-left:4px; }
.row { display:flex; justify-content:space-between; font-variant-numeric:tabular-nums; }
.row span:first-child { color:var(--dim); }
.bar { height:10px; background:#2b3540; border-radius:5px; overflow:hidden; margin:8px 0; }
#pages-bar { height:100%; width:0; background:var(--acc); transition:width .3s; }
svg { width:100%; height:40px; display:block; margin-top:6px; }
#sparkline-line { fill:none; stroke:var(--acc); stroke-width:1.5; }
table { width:100%; border-collapse:collapse; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:2px 6px 2px 0; } th { color:var(--dim); font-weight:500; }
td.n, th.n { text-align:right; }
.hidden { display:none; }
</style></head>
<body>
<header><h1>segkv</h1><span id="status" data-updated="" data-asked="">connecting&hellip;</span></header>
<div class="grid">
 <div class="card"><h2>Decode throughput</h2>
  <span class="big" id="tokens-per-s" data-updated="">&ndash;</span><span class="unit">tokens/s</span>
  <svg id="sparkline" viewBox="0 0 60 20" preserveAspectRatio="none" aria-label="tokens/s, last 60 samples">
   <polyline id="sparkline-line" points=""></polyline></svg></div>
 <div class="card"><h2>Time to first token</h2>
  <span class="big" id="ttft-ms" data-updated="">&ndash;</span><span class="unit">ms (p50)</span></div>
 <div class="card"><h2>Requests</h2>
  <div class="row"><span>running</span><span id="requests-running" data-updated="">&ndash;</span></div>
  <div class="row"><span>waiting</span><span id="requests-waiting" data-updated="">&ndash;</span></div>
  <div class="row"><span>finished</span><span id="requests-finished" data-updated="">&ndash;</span></div>
  <div class="row"><span>preemptions</span><span id="preemptions" data-updated="">&ndash;</span></div>
  <div class="row"><span>steps</span><span id="steps" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2>KV cache</h2>
  <span class="big" id="pages-in-use" data-updated="">&ndash;</span>
  <span class="unit">of <span id="num-pages" data-updated="">&ndash;</span> pages
   (<span id="page-size" data-updated="">&ndash;</span> tokens each)</span>
  <div class="bar"><div id="pages-bar" data-updated=""></div></div>
  <div class="row"><span>bytes in use</span><span id="bytes-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>peak bytes</span><span id="peak-bytes-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>peak pages</span><span id="peak-pages-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>bytes copied</span><span id="bytes-copied" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2>Prefix cache</h2>
  <div class="row"><span>hit tokens</span><span id="prefix-hit-tokens" data-updated="">&ndash;</span></div>
  <div class="row"><span>hit rate (queries)</span>
   <span id="prefix-hit-rate" data-updated="">&ndash;</span></div>
  <div class="row"><span>cached tokens</span>
   <span id="prefix-cached-tokens" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2>Attention routes (forward steps)</h2>
  <table><thead><tr><th>route</th><th class="n">steps</th></tr></thead>
  <tbody id="routes" data-updated=""></tbody></table></div>
 <div class="card hidden" id="sessions-card"><h2>Sessions</h2>
  <table><thead><tr><th>session</th><th class="n">turns</th><th class="n">segments</th>
  <th class="n">peak / turn</th></tr></thead><tbody id="sessions" data-updated=""></tbody></table></div>
</div>
<script>
"use strict";
const HISTORY = 60, samples = [];
const $ = (id) => document.getElementById(id);
function bytes(n) {
  if (n === null || n === undefined) return "\\u2013";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0, v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
function put(id, value, text, now) {
  const el = $(id); if (!el) return;
  const missing = value === null || value === undefined;
  el.textContent = missing ? "\\u2013" : (text === undefined ? String(value) : text);
  el.dataset.value = missing ? "" : String(value);
  el.dataset.updated = String(now);
}
function rows(tbody, items, now) {
  tbody.replaceChildren(...items.map(([key, cells]) => {
    const tr = document.createElement("tr"); tr.dataset.key = key;
    cells.forEach((c, i) => { const td = document.createElement("td");
      td.textContent = String(c); if (i) td.className = "n"; tr.appendChild(td); });
    return tr;
  }));
  tbody.dataset.updated = String(now);
}
function sparkline(tps) {
  samples.push(Number(tps) || 0); while (samples.length > HISTORY) samples.shift();
  const top = Math.max(1e-9, ...samples);
  $("sparkline-line").setAttribute("points", samples.map((v, i) =>
    (i + HISTORY - samples.length) + "," + (20 - 19 * v / top).toFixed(2)).join(" "));
}
function render(s, now) {
  const tps = s.decode_tokens_per_s;
  put("tokens-per-s", tps, tps === undefined ? undefined : Number(tps).toFixed(1), now);
  const ttft = s.ttft_seconds_p50;
  put("ttft-ms", ttft === null || ttft === undefined ? null : Math.round(ttft * 1000), undefined, now);
  put("requests-running", s.running, undefined, now);
  put("requests-waiting", s.waiting, undefined, now);
  put("requests-finished", s.requests_finished, undefined, now);
  put("preemptions", s.preemptions, undefined, now);
  put("steps", s.steps, undefined, now);
  put("pages-in-use", s.pages_in_use, undefined, now);
  put("num-pages", s.num_pages, undefined, now);
  put("page-size", s.page_size, undefined, now);
  put("bytes-in-use", s.bytes_in_use, bytes(s.bytes_in_use), now);
  put("peak-bytes-in-use", s.peak_bytes_in_use, bytes(s.peak_bytes_in_use), now);
  put("peak-pages-in-use", s.peak_pages_in_use, undefined, now);
  put("bytes-copied", s.bytes_copied, bytes(s.bytes_copied), now);
  const used = s.num_pages ? 100 * (s.pages_in_use || 0) / s.num_pages : 0;
  $("pages-bar").style.width = used.toFixed(1) + "%";
  $("pages-bar").dataset.value = used.toFixed(1); $("pages-bar").dataset.updated = String(now);
  const p = s.prefix || {};
  put("prefix-hit-tokens", p.num_hit_tokens, undefined, now);
  put("prefix-hit-rate", p.num_queries ? p.num_hits / p.num_queries : null,
      p.num_queries ? (100 * p.num_hits / p.num_queries).toFixed(1) + "%" : undefined, now);
  put("prefix-cached-tokens", p.num_cached_tokens, undefined, now);
  rows($("routes"), Object.entries(s.routes || {}).sort().map(([r, n]) => [r, [r, n]]), now);
  const sessions = Array.isArray(s.sessions) ? s.sessions : null;
  $("sessions-card").classList.toggle("hidden", !sessions);
  if (sessions) rows($("sessions"), sessions.map((x) => [String(x.id),
      [x.id, x.turns ?? "\\u2013", x.segments ?? "\\u2013", bytes(x.peak_turn_bytes)]]), now);
  sparkline(tps);
}
async function poll() {
  const status = $("status");
  const asked = Date.now();
  try {
    const r = await fetch("dashboard/stats", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const now = Date.now(); render(await r.json(), now);
    status.textContent = "live \\u00b7 " + new Date(now).toLocaleTimeString();
    status.className = ""; status.dataset.updated = String(now); status.dataset.asked = String(asked);
  } catch (e) {
    status.textContent = "offline (" + e.message + ")"; status.className = "offline";
  } finally { setTimeout(poll, 1000); }
}
poll();
</script>
</body></html>
"""


def dashboard_router(stats: Callable[[], dict]) -> APIRouter:
    """``GET /`` serves the dashboard page; ``GET /dashboard/stats`` answers ``stats()`` as JSON.

    ``stats`` is called on a worker thread (it may wait for the engine's lock), once per poll.
    """
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard_page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={**NO_STORE, "Content-Security-Policy": CSP})

    @router.get("/dashboard/stats")
    def dashboard_stats() -> JSONResponse:
        return JSONResponse(jsonable_encoder(stats()), headers=NO_STORE)

    return router
