// The hub's page: polls the hub's own JSON and draws it; actions go through /admin/.
// Everything that comes from the fleet (names, errors) is put in the page as text, never
// as HTML. The admin key, when the hub has one, is asked for once and kept in this tab's
// sessionStorage; a 401 asks again.
"use strict";

const POLL_MS = 2000;
const HISTORY_MS = 5000;
const KEY = "appliance.adminKey";
const STATUS_ORDER = { lost: 0, left: 1, over_limits: 2, paused: 3, cordoned: 4, up: 5 };

let lastStatus = null;
let lastNodes = [];
let needKey = false;
let timer = null;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v; // CSSOM: allowed by the page's CSP
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function badge(state, text) {
  return el("span", { class: `badge s-${state}`, text: text || state.replace("_", " ") });
}

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { authorization: `Bearer ${key}` } : {};
}

class Unauthorized extends Error {}

async function api(path, opts) {
  const r = await fetch(path, { ...(opts || {}), headers: { ...headers(), ...((opts || {}).headers || {}) },
    cache: "no-store" });
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (r.status === 401) throw new Unauthorized(errorText(body) || "the admin key is required");
  if (!r.ok) throw new Error(errorText(body) || `${r.status} ${r.statusText}`);
  return body;
}

function errorText(body) {
  if (!body) return "";
  if (typeof body.error === "string") return body.error;
  if (body.error && body.error.message) return body.error.message;
  return "";
}

function askKey(why) {
  needKey = true;
  const form = document.getElementById("keyform");
  form.hidden = false;
  notice(why, "bad");
  document.getElementById("admin-key").focus();
}

function notice(text, kind) {
  const n = document.getElementById("notice");
  n.textContent = text || "";
  n.className = kind || "";
  n.hidden = !text;
}

function fmtMs(v) {
  if (v === null || v === undefined) return "–";
  return v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${Math.round(v)} ms`;
}

function fmtMiB(v) {
  if (v === null || v === undefined) return "?";
  return v >= 1024 ? `${(v / 1024).toFixed(1)} GiB` : `${v} MiB`;
}

function modelState(m) {
  if (m.parked) return "parked";
  if (m.unplaceable) return "unplaceable";
  if (m.ready) return "ready";
  if (m.loading) return "loading";
  return m.desired ? "available" : "on-demand";
}

// --- actions ------------------------------------------------------------------------------

async function act(what, method, path) {
  if (!window.confirm(`${what}?`)) return;
  try {
    await api(path, { method });
    notice(`${what}: done`, "ok");
  } catch (e) {
    if (e instanceof Unauthorized) askKey(`${what}: ${e.message}`);
    else notice(`${what} failed: ${e.message}`, "bad");
  }
  refresh();
}

const enc = encodeURIComponent;

function retryButton(name) {
  return el("button", { type: "button", class: "primary", "data-action": "retry", "data-model": name,
    "aria-label": `Retry model ${name}`, text: "Retry",
    onclick: () => act(`Retry model ${name}`, "POST", `/admin/models/${enc(name)}/retry`) });
}

function nodeButton(name, action, label, danger) {
  const path = action === "forget" ? `/admin/nodes/${enc(name)}` : `/admin/nodes/${enc(name)}/${action}`;
  return el("button", { type: "button", class: danger ? "danger" : null, "data-action": action, "data-node": name,
    "aria-label": `${label} node ${name}`, text: label,
    onclick: () => act(`${label} node ${name}`, action === "forget" ? "DELETE" : "POST", path) });
}

// --- drawing ------------------------------------------------------------------------------

function drawAttention(status) {
  const list = document.getElementById("attention-list");
  const items = [];
  for (const m of status.models) {
    if (m.parked) {
      items.push(el("li", { class: "alert parked", "data-model": m.name, "data-state": "parked" },
        badge("parked"), el("span", { class: "what", text: m.name }),
        el("span", { class: "detail" },
          `parked after ${m.consecutive_start_failures} failed starts; last error: `,
          el("code", { class: "last-error", text: m.last_error || "(none)" })),
        retryButton(m.name)));
    } else if (m.unplaceable) {
      items.push(el("li", { class: "alert unplaceable", "data-model": m.name, "data-state": "unplaceable" },
        badge("unplaceable"), el("span", { class: "what", text: m.name }),
        el("span", { class: "detail reason", text: m.reason || "fits on no node" }), retryButton(m.name)));
    }
  }
  for (const n of status.nodes) {
    if (n.status === "lost") {
      items.push(el("li", { class: "alert lost", "data-node": n.name, "data-state": "lost" },
        badge("lost"), el("span", { class: "what", text: n.name }),
        el("span", { class: "detail", text: `not connected (${n.url})` })));
    }
  }
  list.replaceChildren(...items);
  document.getElementById("attention").hidden = items.length === 0;
}

// A ready model's load on a node (hub/decide/cost.py): the engine's busy slots where it
// says them, the predicted wait for a place, requests waiting there for their home.
function loadText(m) {
  if (m.state !== "ready" || m.predicted_wait_ms == null) return "";
  const busy = m.busy == null ? "" : `, ${m.busy} of ${m.slots} slots busy`;
  const home = m.home_waiting ? `, ${m.home_waiting} waiting for home` : "";
  return `${busy}, wait ~${Math.round(m.predicted_wait_ms)} ms${home}`;
}

function drawNodes(status, detail) {
  const byName = Object.fromEntries(detail.map((d) => [d.name, d]));
  const nodes = [...status.nodes].sort((a, b) =>
    (STATUS_ORDER[a.status] ?? 9) - (STATUS_ORDER[b.status] ?? 9) || a.name.localeCompare(b.name));
  const cards = nodes.map((n) => {
    const d = byName[n.name] || {};
    const engines = (d.engines || []).map((e) => `${e.kind} ${e.version || ""}`.trim()).join(", ") || "–";
    const used = d.memory_used_mb, total = d.memory_total_mb;
    const pct = total ? Math.min(100, Math.round((100 * (used || 0)) / total)) : 0;
    const mem = total ? el("span", {}, `${fmtMiB(used || 0)} of ${fmtMiB(total)}`,
      el("div", { class: "bar", role: "img", "aria-label": `${pct}% of GPU memory used` },
        el("span", { style: `width:${pct}%` }))) : "not declared";
    const models = (n.models || []).map((m) => `${m.name} (${m.state}${m.health === "replica_unhealthy" ? `, UNHEALTHY: ${m.health_error}` : ""}${m.in_flight ? `, ${m.in_flight} in flight` : ""}${loadText(m)})`);
    const why = n.status === "over_limits" ? d.over_limits_reason : n.status === "lost" ? d.lost_reason : "";
    const actions = el("div", { class: "actions" },
      d.cordoned ? nodeButton(n.name, "uncordon", "Uncordon") : nodeButton(n.name, "cordon", "Cordon"),
      d.paused ? nodeButton(n.name, "resume", "Resume") : nodeButton(n.name, "pause", "Pause"),
      nodeButton(n.name, "forget", "Forget", true));
    return el("article", { class: "card node", "data-node": n.name, "data-status": n.status,
      "aria-label": `node ${n.name}, ${n.status}` },
      el("h3", {}, el("span", { class: "name", text: n.name }), badge(n.status),
        d.cordoned && n.status !== "cordoned" ? badge("cordoned") : null),
      el("dl", {},
        el("dt", { text: "Engine" }), el("dd", { text: engines }),
        el("dt", { text: "GPU memory" }), el("dd", {}, mem),
        el("dt", { text: "In flight" }), el("dd", { text: `${n.in_flight} of ${n.max_concurrency ?? "no limit"}` }),
        el("dt", { text: "Models" }), el("dd", { text: models.join(", ") || "–" }),
        why ? el("dt", { text: "Why" }) : null, why ? el("dd", { text: why }) : null),
      actions);
  });
  const box = document.getElementById("nodes");
  box.replaceChildren(...(cards.length ? cards : [el("p", { class: "muted", text: "No nodes known yet." })]));
}

// How requests were placed (session / prefix / spread) and the share of prompt tokens the
// engines reported cached (hub/decide/affinity.py).
function routingText(r) {
  if (!r) return "–";
  const p = r.placed;
  const hit = r.cache_hit_ratio == null ? "–" : `${Math.round(r.cache_hit_ratio * 100)}%`;
  const w = r.home_waits || {};
  const waited = Object.values(w).reduce((a, b) => a + b, 0);
  const home = waited ? ` · ${waited} waited for home (${w.home || 0} got it)` : "";
  return `${p.session} / ${p.prefix} / ${p.spread} · ${hit} cached${home}`;
}

function drawModels(status) {
  const rank = { parked: 0, unplaceable: 1, loading: 2, available: 3, ready: 4, "on-demand": 5 };
  const models = [...status.models].sort((a, b) =>
    rank[modelState(a)] - rank[modelState(b)] || a.name.localeCompare(b.name));
  const rows = models.map((m) => {
    const st = modelState(m);
    const why = m.parked ? m.last_error : m.reason || m.last_error || "";
    return el("tr", { "data-model": m.name, "data-state": st },
      el("th", { scope: "row", text: m.name }), el("td", {}, badge(st)),
      el("td", { class: "num", text: `${m.ready} / ${m.desired}` }), el("td", { class: "num", text: m.loading }),
      el("td", { class: "num failures", text: m.consecutive_start_failures }),
      el("td", { text: (m.nodes || []).join(", ") || "–" }),
      el("td", { class: "routing", text: routingText(m.routing) }),
      el("td", { class: m.parked || m.unplaceable ? "err" : "", text: why || "–" }));
  });
  document.querySelector("#models tbody").replaceChildren(...rows);
}

function drawPriority(status) {
  const sec = document.getElementById("priority");
  const p = status.priority;
  sec.hidden = !p;
  if (!p) return;
  document.getElementById("priority-reserve").textContent =
    `Reserve: ${p.reserve_slots} place(s) kept from background work; background waits at most ${p.background_max_wait_seconds} s.`;
  const rows = ["essential", "normal", "background"].filter((c) => p[c]).map((c) =>
    el("tr", { "data-class": c }, el("th", { scope: "row", text: c }),
      ...["waiting", "held", "released", "timed_out", "requests"].map((k) => el("td", { class: "num", text: p[c][k] }))));
  document.querySelector("#priority-table tbody").replaceChildren(...rows);
}

function drawTenants(status) {
  const sec = document.getElementById("tenants");
  const t = status.tenants || {};
  const names = Object.keys(t);
  sec.hidden = !names.length;
  const of = (used, limit) => (limit === null || limit === undefined ? `${used}` : `${used} / ${limit}`);
  const rows = names.map((n) => {
    const x = t[n], l = x.limits;
    return el("tr", { "data-client": n }, el("th", { scope: "row", text: n }),
      el("td", { class: "num", text: of(x.minute.requests, l.rpm) }),
      el("td", { class: "num", text: of(x.minute.tokens, l.tpm) }),
      el("td", { class: "num", text: of(x.day_tokens, l.tokens_per_day) }),
      el("td", { class: "num", text: of(x.in_flight, l.max_concurrent) }),
      el("td", { class: "num", text: x.queued }),
      el("td", { class: "num", text: `${x.served.input} / ${x.served.output}` }),
      el("td", { class: "num", text: `${Math.round(x.share * 100)}%` }),
      el("td", { class: x.limited ? "num err" : "num", text: x.limited }));
  });
  document.querySelector("#tenants-table tbody").replaceChildren(...rows);
}

// Batches running on this hub (hub/store/runner.py): a progress bar each.
function drawBatches(status) {
  const sec = document.getElementById("batches");
  const list = status.batches || [];
  sec.hidden = !list.length;
  const rows = list.map((b) => {
    const done = b.completed + b.failed;
    const pct = b.total ? Math.min(100, Math.round((100 * done) / b.total)) : 0;
    return el("tr", { "data-batch": b.id }, el("th", { scope: "row", text: b.id }),
      el("td", { text: b.owner }), el("td", { text: `${b.status} (${b.api})` }),
      el("td", {}, `${done} / ${b.total}`,
        el("div", { class: "bar", role: "img", "aria-label": `${pct}% of the batch done` },
          el("span", { style: `width:${pct}%` }))),
      el("td", { class: "num", text: b.completed }),
      el("td", { class: b.failed ? "num err" : "num", text: b.failed }));
  });
  document.querySelector("#batches-table tbody").replaceChildren(...rows);
}

function drawRecent(recent) {
  const rows = recent.requests.map((r) => el("tr", { "data-status": r.status },
    el("td", { text: new Date(r.ts * 1000).toLocaleTimeString(), title: r.request_id ? `request ${r.request_id}` : null }), el("td", { text: r.client || "–" }),
    el("td", { text: r.model || "–" }), el("td", { text: r.priority || "–" }),
    el("td", { class: r.status >= 400 ? "err" : "", text: r.error ? `${r.status} ${r.error}` : r.status }),
    el("td", { text: r.node || "–" }), el("td", { class: "num", text: fmtMs(r.ttfb_ms) }),
    el("td", { class: "num", text: fmtMs(r.ms) })));
  document.querySelector("#recent tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 8, class: "muted", text: "No requests yet." }))]));
}

// The hour's slowest requests and where their time went (hub/observe/audit.py).
function drawSlow(slow) {
  const n = (v) => (v == null ? "–" : v);
  const rows = slow.requests.map((r) => el("tr", { "data-status": r.status },
    el("td", { text: new Date(r.ts * 1000).toLocaleTimeString(), title: r.trace_id ? `trace ${r.trace_id}` : r.request_id ? `request ${r.request_id}` : null }),
    el("td", { text: r.client || "–" }), el("td", { text: r.model || "–" }), el("td", { text: r.node || "–" }),
    el("td", { class: r.status >= 400 ? "err" : "", text: r.error ? `${r.status} ${r.error}` : r.status }),
    el("td", { class: "num", text: fmtMs(r.ms) }), el("td", { class: "num", text: fmtMs(r.load_ms) }),
    el("td", { class: "num", text: fmtMs(r.queue_ms) }), el("td", { class: "num", text: fmtMs(r.node_wait_ms) }),
    el("td", { class: "num", text: fmtMs(r.ttfb_ms) }),
    el("td", { class: "num", text: `${n(r.prefill_tokens)} / ${n(r.cached_tokens)}` }),
    el("td", { class: "num", text: n(r.output_tokens) }), el("td", { class: "num", text: n(r.decode_tps) })));
  document.querySelector("#slow tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 13, class: "muted", text: "No requests in the last hour." }))]));
}

// --- charts (inline SVG, no library) ----------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["var(--c1)", "var(--c2)", "var(--c3)", "var(--c4)", "var(--c5)"];

function chart(title, series, unit, window_s) {
  const W = 300, H = 90, now = Date.now() / 1000;
  // A young hub has less than the window: span what there is (at least a minute).
  const first = Math.min(...series.flatMap((s) => s.points.map(([t]) => t)), now);
  const span = Math.max(60, Math.min(window_s, now - first));
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  let max = 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
  const top = max > 0 ? max * 1.1 : 1;
  const base = document.createElementNS(SVG, "line");
  Object.entries({ x1: 0, y1: H - 1, x2: W, y2: H - 1, class: "axis" }).forEach(([k, v]) => base.setAttribute(k, v));
  svg.append(base);
  series.forEach((s, i) => {
    const pts = s.points.filter(([, v]) => v !== null)
      .map(([t, v]) => `${(W * (1 - (now - t) / span)).toFixed(1)},${(H - 2 - (H - 4) * (v / top)).toFixed(1)}`);
    if (!pts.length) return;
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("points", pts.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLORS[i % COLORS.length]);
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
  });
  const last = series.map((s) => {
    const v = s.points.length ? s.points[s.points.length - 1][1] : null;
    return `${s.name} ${v === null ? "–" : `${+v.toFixed(2)}${unit}`}`;
  });
  svg.setAttribute("role", "img");
  const spanText = span >= window_s ? "last 15 minutes" : `last ${Math.round(span)} s`;
  svg.setAttribute("aria-label", `${title}, ${spanText}; now: ${last.join(", ") || "no data"}`);
  const legend = el("div", { class: "legend" }, ...series.map((s, i) =>
    el("span", {}, el("span", { class: "key", style: `background:${COLORS[i % COLORS.length]}` }), last[i])));
  return el("figure", { class: "chart" }, el("figcaption", { text: title }), svg,
    series.length ? legend : el("div", { class: "legend", text: "no data yet" }));
}

function drawCharts(h) {
  const pts = h.points;
  const statuses = [...new Set(pts.flatMap((p) => Object.keys(p.rps)))].sort();
  const waitKeys = [...new Set(pts.flatMap((p) => Object.keys(p.waiting)))];
  const tokenKinds = [...new Set(pts.flatMap((p) => Object.keys(p.tokens_per_s || {})))].sort();
  const series = (key) => (name) => ({ name, points: pts.map((p) => [p.t, key(p, name)]) });
  document.getElementById("charts").replaceChildren(
    chart("Requests per second by status", statuses.map(series((p, s) => p.rps[s] || 0)), "/s", h.window_seconds),
    chart("Time to first byte", [series((p) => p.ttfb_p50_ms)("p50"), series((p) => p.ttfb_p95_ms)("p95")],
      " ms", h.window_seconds),
    chart("Tokens per second", tokenKinds.map(series((p, k) => (p.tokens_per_s || {})[k] || 0)), "/s",
      h.window_seconds),
    chart("Queue depth", waitKeys.map(series((p, k) => p.waiting[k] || 0)), "", h.window_seconds),
    chart("In flight and nodes up", [series((p) => p.in_flight)("in flight"), series((p) => p.nodes_up)("nodes up")],
      "", h.window_seconds));
}

function drawSummary(status) {
  const up = status.nodes.filter((n) => n.status === "up").length;
  const parked = status.models.filter((m) => m.parked).length;
  const unpl = status.models.filter((m) => m.unplaceable).length;
  const ready = status.models.filter((m) => m.ready).length;
  let text = `v${status.version} · ${up} of ${status.nodes.length} nodes up · ${ready} of ${status.models.length} models ready`;
  if (parked) text += ` · ${parked} parked`;
  if (unpl) text += ` · ${unpl} unplaceable`;
  document.getElementById("summary").textContent = `${text} · updated ${new Date().toLocaleTimeString()}`;
}

// --- polling --------------------------------------------------------------------------------

let lastHistory = 0;

let refreshing = false;

async function refresh() {
  if (needKey || refreshing) return; // a slow hub: one poll at a time
  refreshing = true;
  try {
    const [status, nodes, recent] = await Promise.all([
      api("/api/status"), api("/admin/nodes"), api("/api/requests/recent?limit=50")]);
    lastStatus = status;
    lastNodes = nodes.nodes;
    drawSummary(status);
    drawAttention(status);
    drawNodes(status, lastNodes);
    drawModels(status);
    drawPriority(status);
    drawTenants(status);
    drawBatches(status);
    drawRecent(recent);
    if (Date.now() - lastHistory >= HISTORY_MS) {
      lastHistory = Date.now();
      drawCharts(await api("/api/status/history"));
      drawSlow(await api("/api/requests/slow?limit=10"));
    }
    document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY);
    const n = document.getElementById("notice");
    if (n.dataset.stale) { delete n.dataset.stale; notice(""); }
  } catch (e) {
    if (e instanceof Unauthorized) askKey(sessionStorage.getItem(KEY) ? "That admin key was refused." :
      "This hub needs its admin key.");
    else {
      notice(`The hub did not answer: ${e.message}`, "bad");
      document.getElementById("notice").dataset.stale = "1";
    }
  } finally {
    refreshing = false;
  }
}

document.getElementById("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("admin-key");
  sessionStorage.setItem(KEY, input.value);
  input.value = "";
  document.getElementById("keyform").hidden = true;
  needKey = false;
  notice("");
  refresh();
});

document.getElementById("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  location.reload();
});

refresh();
timer = setInterval(refresh, POLL_MS);
