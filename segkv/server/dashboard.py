"""The live dashboard: one self-contained HTML page that polls the engine's live stats."""

from __future__ import annotations

import time
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
:root { --bg:#0f1419; --card:#1a2129; --fg:#e6e6e6; --dim:#8a96a3; --acc:#4fc3f7; --warn:#ffb74d;
        --run:#4fc3f7; --pin:#ba68c8; --cache:#5f7d8e; }
* { box-sizing: border-box; }
body { margin:0; padding:16px; background:var(--bg); color:var(--fg);
       font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { display:flex; flex-wrap:wrap; align-items:baseline; gap:4px 16px; margin-bottom:12px; }
h1 { font-size:18px; margin:0; } h2 { font-size:13px; margin:0 0 8px; color:var(--dim);
     text-transform:uppercase; letter-spacing:.05em; font-weight:600;
     white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
.meta { color:var(--dim); font-size:13px; white-space:nowrap; }
.meta b { color:var(--fg); font-weight:500; font-variant-numeric:tabular-nums; }
#model { display:inline-block; max-width:40ch; overflow:hidden; text-overflow:ellipsis; vertical-align:bottom; }
#status { color:var(--dim); font-size:12px; margin-left:auto; } #status.offline { color:var(--warn); }
/* cards keep their own height (align-items:start): a short card is not stretched to its row */
.grid { display:grid; grid-template-columns:repeat(auto-fill, minmax(260px, 1fr)); gap:12px;
        align-items:start; }
.card { background:var(--card); border-radius:8px; padding:12px 14px; min-width:0; }
.wide { grid-column:span 2; }
@media (max-width:600px) { .wide { grid-column:auto; } }
.big { font-size:28px; font-variant-numeric:tabular-nums; }
.unit { color:var(--dim); font-size:12px; margin-left:4px; white-space:nowrap; }
.row { display:flex; justify-content:space-between; gap:8px; font-variant-numeric:tabular-nums; }
.row > span:first-child { color:var(--dim); white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
.row > span:last-child { white-space:nowrap; }
.sw { display:inline-block; width:9px; height:9px; border-radius:2px; margin-right:6px; }
.bar { height:10px; background:#2b3540; border-radius:5px; overflow:hidden; margin:8px 0; }
/* #pages-bar spans the used share of the pool; its parts split it by holder */
#pages-bar { height:100%; width:0; display:flex; transition:width .3s; }
#pages-bar > div { height:100%; }
.run { background:var(--run); } .pin { background:var(--pin); } .cache { background:var(--cache); }
svg { width:100%; height:40px; display:block; margin-top:6px; }
#sparkline-line { fill:none; stroke:var(--acc); stroke-width:1.5; }
table { width:100%; border-collapse:collapse; table-layout:fixed; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:2px 8px 2px 0; white-space:nowrap; overflow:hidden; text-overflow:ellipsis; }
th { color:var(--dim); font-weight:500; } td.n, th.n { text-align:right; }
th:last-child, td:last-child { padding-right:0; }
.scroll { max-height:260px; overflow-y:auto; }
#sessions-more { color:var(--dim); font-size:12px; margin-top:4px; }
.hidden { display:none; }
</style></head>
<body>
<header><h1>segkv</h1>
 <span class="meta">model <b id="model" data-updated="">&ndash;</b></span>
 <span class="meta">context <b id="max-model-len" data-updated="">&ndash;</b> tokens</span>
 <span class="meta">up <b id="uptime" data-updated="">&ndash;</b></span>
 <span id="status" data-updated="" data-asked="">connecting&hellip;</span></header>
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
 <div class="card"><h2>KV cache pages</h2>
  <span class="big" id="pages-in-use" data-updated="">&ndash;</span>
  <span class="unit">in use of <span id="num-pages" data-updated="">&ndash;</span>
   (<span id="pages-share" data-updated="">&ndash;</span>)</span>
  <div class="bar"><div id="pages-bar" data-updated="">
   <div class="run" id="pages-bar-requests"></div><div class="pin" id="pages-bar-pinned"></div>
   <div class="cache" id="pages-bar-cached"></div></div></div>
  <div class="row" title="pages the chains of running and waiting requests hold">
   <span><i class="sw run"></i>running requests</span><span id="pages-requests" data-updated="">&ndash;</span></div>
  <div class="row" title="pages held outside running requests, e.g. by session turns">
   <span><i class="sw pin"></i>pinned by sessions</span><span id="pages-pinned" data-updated="">&ndash;</span></div>
  <div class="row" title="pages only the prefix index holds: freed first when pages run out">
   <span><i class="sw cache"></i>cached prefixes (evictable)</span>
   <span id="pages-cached" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2>KV cache memory</h2>
  <div class="row"><span>page size</span><span><span id="page-size" data-updated="">&ndash;</span> tokens</span></div>
  <div class="row"><span>bytes in use</span><span id="bytes-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>peak bytes</span><span id="peak-bytes-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>peak pages</span><span id="peak-pages-in-use" data-updated="">&ndash;</span></div>
  <div class="row"><span>bytes copied</span><span id="bytes-copied" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2>Prefix cache</h2>
  <div class="row"><span>hit tokens</span><span id="prefix-hit-tokens" data-updated="">&ndash;</span></div>
  <div class="row"><span>hit rate (queries)</span>
   <span id="prefix-hit-rate" data-updated="">&ndash;</span></div>
  <div class="row"><span>cached segments</span>
   <span id="prefix-cached-segments" data-updated="">&ndash;</span></div>
  <div class="row"><span>cached tokens</span>
   <span id="prefix-cached-tokens" data-updated="">&ndash;</span></div></div>
 <div class="card"><h2 title="forward steps per attention route">Attention routes</h2>
  <table><colgroup><col><col style="width:40%"></colgroup>
  <thead><tr><th>route</th><th class="n">steps</th></tr></thead>
  <tbody id="routes" data-updated=""></tbody></table></div>
 <div class="card hidden" id="spec-card"><h2 title="verify windows of speculative decoding">Speculative decoding</h2>
  <div class="row"><span>method</span><span id="spec-method" data-updated="">&ndash;</span></div>
  <div class="row" title="accepted draft tokens / draft tokens">
   <span>acceptance rate</span><span id="spec-acceptance-rate" data-updated="">&ndash;</span></div>
  <div class="row" title="tokens per verify window: the accepted drafts and the one drawn after them">
   <span>mean accepted length</span><span id="spec-mean-accepted-length" data-updated="">&ndash;</span></div>
  <div class="row"><span>windows</span><span id="spec-drafts" data-updated="">&ndash;</span></div>
  <div class="row"><span>draft tokens</span><span id="spec-draft-tokens" data-updated="">&ndash;</span></div>
  <div class="row"><span>accepted tokens</span><span id="spec-accepted-tokens" data-updated="">&ndash;</span></div></div>
 <div class="card hidden" id="tiers-card"><h2 title="idle segments' copies below the GPU's pages">KV tiers</h2>
  <table><colgroup><col><col style="width:22%"><col style="width:30%"><col style="width:20%"></colgroup>
  <thead><tr><th>tier</th><th class="n">segments</th><th class="n">bytes</th><th class="n">hits</th></tr></thead>
  <tbody id="tiers" data-updated=""></tbody></table>
  <div class="row" title="segments asked of the tiers that no tier held"><span>misses</span>
   <span id="tiers-misses" data-updated="">&ndash;</span></div>
  <div class="row" title="rows recomputed because their copy was lost or bad">
   <span>recomputed rows</span><span id="tiers-recomputed" data-updated="">&ndash;</span></div>
  <div class="row"><span>to host</span><span id="tiers-rate-to-host" data-updated="">&ndash;</span></div>
  <div class="row"><span>back into pages</span><span id="tiers-rate-from-host" data-updated="">&ndash;</span></div>
  <div class="row"><span>to disk</span><span id="tiers-rate-to-disk" data-updated="">&ndash;</span></div>
  <div class="row"><span>from disk</span><span id="tiers-rate-from-disk" data-updated="">&ndash;</span></div></div>
 <div class="card wide hidden" id="sessions-card"><h2>Sessions (<span id="sessions-count">0</span>)</h2>
  <div class="scroll"><table><colgroup><col><col style="width:12%"><col style="width:14%">
   <col style="width:14%"><col style="width:18%"><col style="width:14%"></colgroup>
  <thead><tr><th>session</th><th class="n">turns</th><th class="n">messages</th><th class="n">segments</th>
  <th class="n" title="the most KV bytes one turn added">peak / turn</th><th class="n">idle</th></tr></thead>
  <tbody id="sessions" data-updated=""></tbody></table></div>
  <div id="sessions-more" class="hidden"></div></div>
</div>
<script>
"use strict";
const HISTORY = 60, MAX_SESSION_ROWS = 200, DASH = "\\u2013", samples = [];
const $ = (id) => document.getElementById(id);
const missing = (v) => v === null || v === undefined;
function bytes(n) {
  if (missing(n)) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0, v = Number(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
function duration(seconds) {  // 42s, 3m 07s, 2h 05m, 3d 4h: two units at most
  if (missing(seconds)) return DASH;
  const s = Math.max(0, Math.floor(Number(seconds))), pad = (n) => String(n).padStart(2, "0");
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h " + pad(Math.floor(s / 60) % 60) + "m";
  return Math.floor(s / 86400) + "d " + Math.floor(s / 3600) % 24 + "h";
}
function put(id, value, text, now) {
  const el = $(id); if (!el) return;
  el.textContent = missing(value) ? DASH : (text === undefined ? String(value) : text);
  el.dataset.value = missing(value) ? "" : String(value);
  el.dataset.updated = String(now);
}
function rows(tbody, items, now) {
  tbody.replaceChildren(...items.map(([key, cells]) => {
    const tr = document.createElement("tr"); tr.dataset.key = key;
    cells.forEach((c, i) => { const td = document.createElement("td");
      td.textContent = String(c); td.title = String(c); if (i) td.className = "n"; tr.appendChild(td); });
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
function pages(s, now) {
  // in use = requests + pinned + cached: cached pages are held only by the prefix index
  // (evictable), pinned ones by something outside running requests (session turns)
  put("pages-in-use", s.pages_in_use, undefined, now);
  put("num-pages", s.num_pages, missing(s.num_pages) ? undefined : Number(s.num_pages).toLocaleString("en-US"), now);
  const used = s.pages_in_use || 0, req = s.pages_requests, cached = s.pages_cached_only;
  const pinned = missing(req) || missing(cached) ? null : Math.max(0, used - req - cached);
  put("pages-requests", req, undefined, now);
  put("pages-pinned", pinned, undefined, now);
  put("pages-cached", cached, undefined, now);
  const share = s.num_pages ? 100 * used / s.num_pages : 0, bar = $("pages-bar");
  bar.style.width = share.toFixed(1) + "%";
  bar.dataset.value = share.toFixed(1); bar.dataset.updated = String(now);
  put("pages-share", missing(s.num_pages) ? null : share, (share && share < 0.1 ? "<0.1" : share.toFixed(1)) + "%", now);
  const part = (n) => (used && !missing(n) ? 100 * n / used : 0).toFixed(1) + "%";
  $("pages-bar-requests").style.width = part(req);
  $("pages-bar-pinned").style.width = part(pinned);
  $("pages-bar-cached").style.width = part(cached);
}
function sessions(list, now) {
  $("sessions-card").classList.toggle("hidden", !list);
  if (!list) return;
  // most recently used first; a long list scrolls inside the card and is cut at MAX_SESSION_ROWS
  const shown = [...list].sort((a, b) => (a.idle_seconds ?? 0) - (b.idle_seconds ?? 0))
    .slice(0, MAX_SESSION_ROWS);
  put("sessions-count", list.length, undefined, now);
  rows($("sessions"), shown.map((x) => [String(x.id), [x.id, x.turns ?? DASH, x.messages ?? DASH,
      x.segments ?? DASH, bytes(x.peak_turn_bytes), duration(x.idle_seconds)]]), now);
  const more = $("sessions-more"), hidden = list.length - shown.length;
  more.textContent = hidden > 0 ? "and " + hidden + " more" : "";
  more.classList.toggle("hidden", hidden <= 0);
}
function speculative(x, now) {  // null: speculation is off, no card
  $("spec-card").classList.toggle("hidden", !x);
  if (!x) return;
  put("spec-method", x.method, x.method + " (k=" + x.num_speculative_tokens + ")", now);
  const rate = x.acceptance_rate, length = x.mean_accepted_length;
  put("spec-acceptance-rate", rate, missing(rate) ? undefined : (100 * rate).toFixed(1) + "%", now);
  put("spec-mean-accepted-length", length, missing(length) ? undefined : Number(length).toFixed(2), now);
  put("spec-drafts", x.num_drafts, undefined, now);
  put("spec-draft-tokens", x.num_draft_tokens, undefined, now);
  put("spec-accepted-tokens", x.num_accepted_tokens, undefined, now);
}
function tiers(t, now) {  // null: the engine has no KV tiers, no card
  $("tiers-card").classList.toggle("hidden", !t);
  if (!t) return;
  rows($("tiers"), ["host", "disk"].map((tier) => [tier, [tier, t[tier + "_segments"],
       bytes(t[tier + "_bytes"]) + " / " + bytes(t[tier + "_capacity"]), t[tier + "_hits"]]]), now);
  put("tiers-misses", t.misses, undefined, now);
  put("tiers-recomputed", t.recomputed_rows, undefined, now);
  for (const d of ["to_host", "from_host", "to_disk", "from_disk"]) {
    const rate = t[d + "_bytes_per_s"];
    put("tiers-rate-" + d.replace("_", "-"), rate, rate ? bytes(rate) + "/s" : DASH, now);
  }
}
function render(s, now) {
  put("model", s.model, undefined, now); $("model").title = s.model ?? "";
  put("max-model-len", s.max_model_len, missing(s.max_model_len) ? undefined
      : Number(s.max_model_len).toLocaleString("en-US"), now);
  put("uptime", s.uptime_seconds, duration(s.uptime_seconds), now);
  const tps = s.decode_tokens_per_s;
  put("tokens-per-s", tps, tps === undefined ? undefined : Number(tps).toFixed(1), now);
  const ttft = s.ttft_seconds_p50;
  put("ttft-ms", missing(ttft) ? null : Math.round(ttft * 1000), undefined, now);
  put("requests-running", s.running, undefined, now);
  put("requests-waiting", s.waiting, undefined, now);
  put("requests-finished", s.requests_finished, undefined, now);
  put("preemptions", s.preemptions, undefined, now);
  put("steps", s.steps, undefined, now);
  pages(s, now);
  put("page-size", s.page_size, undefined, now);
  put("bytes-in-use", s.bytes_in_use, bytes(s.bytes_in_use), now);
  put("peak-bytes-in-use", s.peak_bytes_in_use, bytes(s.peak_bytes_in_use), now);
  put("peak-pages-in-use", s.peak_pages_in_use, undefined, now);
  put("bytes-copied", s.bytes_copied, bytes(s.bytes_copied), now);
  const p = s.prefix || {};
  put("prefix-hit-tokens", p.num_hit_tokens, undefined, now);
  put("prefix-hit-rate", p.num_queries ? p.num_hits / p.num_queries : null,
      p.num_queries ? (100 * p.num_hits / p.num_queries).toFixed(1) + "%" : undefined, now);
  put("prefix-cached-segments", p.num_nodes, undefined, now);
  put("prefix-cached-tokens", p.num_cached_tokens, undefined, now);
  rows($("routes"), Object.entries(s.routes || {}).sort().map(([r, n]) => [r, [r, n]]), now);
  speculative(s.speculative || null, now);
  tiers(s.kv_tiers || null, now);
  sessions(Array.isArray(s.sessions) ? s.sessions : null, now);
  sparkline(tps);
}
const KEY = new URLSearchParams(location.search).get("key");  // a server with --api-key: open /?key=<key>
async function fetchStats() {  // the one request the page makes: options such as headers go here
  const headers = KEY ? {Authorization: "Bearer " + KEY} : {};
  const r = await fetch("dashboard/stats", {cache: "no-store", headers});
  if (!r.ok) throw new Error("HTTP " + r.status);
  return r.json();
}
async function poll() {
  const status = $("status");
  const asked = Date.now();
  try {
    const stats = await fetchStats();
    const now = Date.now(); render(stats, now);
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


def dashboard_router(stats: Callable[[], dict], *, model_name: str | None = None,
                     max_model_len: int | None = None, started: float | None = None) -> APIRouter:
    """``GET /`` serves the dashboard page; ``GET /dashboard/stats`` answers ``stats()`` as JSON.

    The answer adds ``model``, ``max_model_len`` and ``uptime_seconds`` (since ``started``, a
    ``time.time()`` value; the router's creation if None). ``stats`` is called on a worker
    thread (it may wait for the engine's lock), once per poll.
    """
    router = APIRouter()
    started = time.time() if started is None else started

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard_page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={**NO_STORE, "Content-Security-Policy": CSP})

    @router.get("/dashboard/stats")
    def dashboard_stats() -> JSONResponse:
        # the server's clock gives the uptime: the browser's may be set differently
        about = {"model": model_name, "max_model_len": max_model_len,
                 "uptime_seconds": round(max(0.0, time.time() - started), 1)}
        return JSONResponse(jsonable_encoder({**stats(), **about}), headers=NO_STORE)

    return router
