// tokenmill dashboard: no build step, no libraries. Charts are drawn on <canvas> by the helpers below.
// Data: one server-sent-events stream (/dashboard/api/events) read with fetch() so that the API key can go
// in an Authorization header (EventSource cannot send headers; a key in the URL would end up in logs).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "tokenmill-api-key";
const HISTORY = 240;  // points kept per time series (~60 s at 4 snapshots/s)
const COLOURS = ["#3a78e8", "#e8833a", "#2b9a57", "#c9372c", "#8e5bd6", "#1aa3a3", "#b08a1e", "#d6469b"];

let apiKey = sessionStorage.getItem(KEY_STORE) || "";
const headers = () => (apiKey ? { Authorization: "Bearer " + apiKey } : {});

function fmt(x, digits = 1) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 1e4) return Math.round(x).toLocaleString("en-US");
  return Number(x).toFixed(digits);
}
const esc = (x) => String(x).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(1));

// -- charts ---------------------------------------------------------------------------------------------
function setupCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 300, h = canvas.clientHeight || 150;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10px system-ui, sans-serif";
  return { ctx, w, h };
}

function axes(ctx, w, h, ymax, pad) {
  ctx.strokeStyle = "#e2e5ea";
  ctx.fillStyle = "#6b7385";
  for (let i = 0; i <= 4; i++) {
    const y = pad.t + (h - pad.t - pad.b) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
    ctx.fillText(fmt((ymax * i) / 4, ymax < 4 ? 2 : 0), 2, y + 3);
  }
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v);
}

// series: [{name, colour, values: [number|null]}]
function lineChart(canvas, series, legendEl) {
  const { ctx, w, h } = setupCanvas(canvas);
  const pad = { l: 36, r: 6, t: 6, b: 6 };
  const all = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
  const ymax = niceMax(Math.max(0, ...all));
  axes(ctx, w, h, ymax, pad);
  const n = Math.max(2, ...series.map((s) => s.values.length));
  const x = (i) => pad.l + ((w - pad.l - pad.r) * i) / (n - 1);
  const y = (v) => pad.t + (h - pad.t - pad.b) * (1 - v / ymax);
  for (const s of series) {
    ctx.strokeStyle = s.colour; ctx.lineWidth = 1.5; ctx.beginPath();
    let pen = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { pen = false; return; }
      if (pen) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
      pen = true;
    });
    ctx.stroke();
  }
  if (legendEl) legend(legendEl, series.map((s) => [s.colour, s.name]));
}

function legend(el, items) {
  const html = items.map(([c, name]) => `<span><i style="background:${c}"></i>${esc(name)}</span>`).join("");
  if (el.innerHTML !== html) el.innerHTML = html;
}

// MFU/MBU 0 -> pale, >= 1 -> saturated: how close a step ran to the device's limit
function heat(u, base) {
  if (u === null || u === undefined || u < 0) return base;
  const a = Math.min(1, Math.max(0.15, u * 2));  // 50% of the roofline is already very good
  return `rgba(${base},${a})`;
}

function stepChart(canvas, steps, colourBy) {
  const { ctx, w, h } = setupCanvas(canvas);
  const pad = { l: 36, r: 6, t: 6, b: 6 };
  const ymax = niceMax(Math.max(1, ...steps.map((s) => s[2] + s[3])));
  axes(ctx, w, h, ymax, pad);
  const n = Math.max(steps.length, 60);
  const bw = (w - pad.l - pad.r) / n;
  const y = (v) => (h - pad.t - pad.b) * (v / ymax);
  steps.forEach((s, i) => {
    const x = pad.l + i * bw, u = s[colourBy];
    const dh = y(s[3]), ph = y(s[2]);
    ctx.fillStyle = u >= 0 ? heat(u, "58,120,232") : "#3a78e8";
    ctx.fillRect(x, h - pad.b - dh, Math.max(1, bw - 1), dh);
    ctx.fillStyle = u >= 0 ? heat(u, "232,131,58") : "#e8833a";
    ctx.fillRect(x, h - pad.b - dh - ph, Math.max(1, bw - 1), ph);
  });
}

function barChart(canvas, values, colour) {
  const { ctx, w, h } = setupCanvas(canvas);
  const pad = { l: 36, r: 6, t: 6, b: 14 };
  const ymax = niceMax(Math.max(0.01, ...values));
  axes(ctx, w, h, ymax, pad);
  const bw = (w - pad.l - pad.r) / Math.max(values.length, 1);
  values.forEach((v, i) => {
    const bh = (h - pad.t - pad.b) * (v / ymax);
    ctx.fillStyle = colour;
    ctx.fillRect(pad.l + i * bw + 2, h - pad.b - bh, Math.max(1, bw - 4), bh);
    ctx.fillStyle = "#6b7385";
    ctx.fillText(String(i + 1), pad.l + i * bw + bw / 2 - 3, h - 2);
  });
}

// -- the stream -----------------------------------------------------------------------------------------
async function api(path) {
  const r = await fetch(path, { headers: headers(), cache: "no-store" });
  if (r.status === 401) throw Object.assign(new Error("unauthorized"), { status: 401 });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function stream(onSnapshot) {
  const status = $("status");
  for (;;) {
    try {
      const r = await fetch("/dashboard/api/events", { headers: headers(), cache: "no-store" });
      if (r.status === 401) { askKey("the key was refused"); return; }
      if (!r.ok || !r.body) throw new Error(`HTTP ${r.status}`);
      status.textContent = "live"; status.className = "pill live";
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) onSnapshot(JSON.parse(data));
        }
      }
    } catch (e) {
      console.warn("dashboard stream:", e.message);
    }
    status.textContent = "reconnecting"; status.className = "pill down";
    await new Promise((res) => setTimeout(res, 2000));
  }
}

function askKey(message) {
  $("key-form").hidden = false;
  $("first-snapshot").hidden = true;
  $("engine-view").hidden = $("router-view").hidden = true;
  $("key-error").textContent = message || "";
  $("status").textContent = "needs API key"; $("status").className = "pill down";
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  start();
});

// -- engine view ----------------------------------------------------------------------------------------
const hist = { gen: [], prompt: [], lat: {} };
const LAT_SERIES = [["ttft", "p50"], ["ttft", "p90"], ["ttft", "p99"], ["itl", "p50"], ["itl", "p90"], ["itl", "p99"]];
let selected = null, lastConfigAt = 0;

function push(arr, v) { arr.push(v); if (arr.length > HISTORY) arr.shift(); }

function renderEngine(s) {
  const e = s.engine || {}, tp = s.throughput || {};
  $("v-running").textContent = e.running ?? "–";
  $("v-waiting").textContent = e.waiting ?? "–";
  $("v-waiting").title = e.held ? `${e.held} of them held back by the API process` : "";
  $("v-preemptions").textContent = e.preemptions ?? "–";
  $("v-gen-tps").textContent = fmt(tp.generation_tok_s);
  $("v-user-tps").textContent = fmt(tp.per_user_tok_s);
  $("v-finished").textContent = tp.finished_requests ?? "–";
  $("v-gen-tokens").textContent = tp.generation_tokens ?? "–";
  $("v-steps").textContent = s.num_steps ?? "–";
  $("status").textContent = s.alive ? "live" : "engine down";
  $("status").className = "pill " + (s.alive ? "live" : "down");
  $("status").title = `this view costs the server ${fmt(s.snapshot_ms)} ms per snapshot ` +
    `(${fmt(100 * (s.snapshot_busy ?? 0))}% of one core)`;

  push(hist.gen, tp.generation_tok_s ?? null);
  push(hist.prompt, tp.prompt_tok_s ?? null);
  lineChart($("c-throughput"), [
    { name: "output tok/s", colour: COLOURS[0], values: hist.gen },
    { name: "prompt tok/s (finished requests)", colour: COLOURS[1], values: hist.prompt }], $("l-throughput"));
  renderLatency(s.latency || {});
  stepChart($("c-steps"), s.steps || [], Number($("step-colour").value));
  legend($("l-steps"), [["#e8833a", "prefill tokens"], ["#3a78e8", "decode tokens"],
    ["rgba(58,120,232,0.2)", "pale = far from the roofline"], ["rgba(58,120,232,1)", "deep = MFU/MBU >= 50%"]]);
  renderKV(e);
  renderSpec(e.spec);
  renderRequests(s.requests || []);
  if (Date.now() - lastConfigAt > 5000) { lastConfigAt = Date.now(); loadConfig(e.running || 0); }
}

function renderLatency(lat) {
  for (const [m, q] of LAT_SERIES) {
    const k = `${m} ${q}`;
    hist.lat[k] = hist.lat[k] || [];
    const v = lat[m] ? lat[m][q] : null;
    push(hist.lat[k], v === null || v === undefined ? null : 1000 * v);
  }
  lineChart($("c-latency"), LAT_SERIES.map(([m, q], i) => ({
    name: `${m.toUpperCase()} ${q.toUpperCase()}`, colour: COLOURS[i], values: hist.lat[`${m} ${q}`] })), $("l-latency"));
  const rows = ["ttft", "itl", "e2e"].map((m) => {
    const p = lat[m] || {};
    return `<tr><td>${m.toUpperCase()}</td><td>${ms(p.p50)}</td><td>${ms(p.p90)}</td><td>${ms(p.p99)}</td></tr>`;
  }).join("");
  $("t-latency").tBodies[0].innerHTML = rows;
  // every figure above is over the same requests: say which
  const n = lat.requests ?? 0, none = lat.without_token ?? 0;
  $("v-latency-set").textContent = (n ? `all over the ${n} request${n === 1 ? "" : "s"} that ended in the last ` +
    `${fmt(lat.window_s ?? 60, 0)} s with a first token` : "no request has ended in the last " +
    `${fmt(lat.window_s ?? 60, 0)} s yet`) + (none ? `; ${none} more ended before their first token` : "");
}

function renderKV(e) {
  const kv = e.kv, px = e.prefix || {};
  if (kv && kv.total) {
    const bar = $("kv-bar").children;
    bar[0].style.width = (100 * kv.used) / kv.total + "%";
    bar[1].style.width = (100 * kv.cached_free) / kv.total + "%";
    bar[2].style.width = (100 * kv.free) / kv.total + "%";
    legend($("l-kv"), [["#3a78e8", `used ${kv.used}`], ["#9bc0f5", `cached, free ${kv.cached_free}`],
      ["#eef0f3", `free ${kv.free}`], ["#fff", `of ${kv.total} blocks (${pct(kv.usage)} in use)`]]);
  }
  $("v-hit").textContent = pct(px.hit_rate);
  $("v-hit-device").textContent = pct(px.device_hit_rate);
  $("v-hit-tier").textContent = pct(px.tier_hit_rate);
  $("v-hit-counts").textContent = px.queries === undefined ? "–" : `${px.queries} / ${px.hits + px.external_hits}`;
}

function renderSpec(spec) {
  if (!spec || !spec.drafts) { $("v-spec").textContent = "no speculation (--speculative-config) in this run"; return; }
  barChart($("c-spec"), spec.acceptance_per_pos, "#2b9a57");
  $("v-spec").textContent = `${spec.accepted} of ${spec.draft_tokens} drafted tokens accepted ` +
    `(${pct(spec.accepted / spec.draft_tokens)}), k = ${spec.k}; bar i: share of rounds whose draft i was accepted`;
}

// One row per open request (its waiting and running sequences in data-waiting / data-running: they add up
// to the tiles, which the server counts from the same rows), a row for the open ones not listed and one for
// the sequences the API process still holds back, then the recently finished.
function requestRow(r) {
  const counts = `data-state="${r.state}" data-waiting="${r.waiting}" data-running="${r.running}"`;
  if (r.id === null) {
    const what = r.state === "held" ? `${r.count} sequences held back by the API (a large request is sent a window at a time)`
      : `${r.count} more open requests`;
    return `<tr class="summary" ${counts}><td colspan="2">${what}</td><td colspan="7">` +
      `${r.waiting} waiting, ${r.running} running</td></tr>`;
  }
  const partly = r.state === "running" && r.waiting ? ` (${r.waiting} of ${r.sequences} waiting)` : "";
  return `<tr data-id="${encodeURIComponent(r.id)}" ${counts}${r.id === selected ? ' class="sel"' : ""}>` +
    `<td title="${esc(r.id)}">${esc(r.id)}</td><td>${r.state}${partly}</td><td>${r.sequences}</td>` +
    `<td>${r.prompt_tokens}</td><td>${r.output_tokens}</td><td>${r.cached_tokens}</td><td>${ms(r.ttft)}</td>` +
    `<td>${ms(r.itl)}</td><td>${fmt(r.age)}</td></tr>`;
}

function renderRequests(rows) {
  $("t-requests").tBodies[0].innerHTML = rows.map(requestRow).join("");
  // keep the selected request's timing fresh while it runs; once finished it no longer changes
  const row = rows.find((r) => r.id !== null && r.id === selected);
  if (row && (row.state !== "finished" || !detailFinal)) { detailFinal = row.state === "finished"; showRequest(selected, false); }
}

$("t-requests").addEventListener("click", (ev) => {
  const tr = ev.target.closest("tr[data-id]");
  if (tr) { detailFinal = false; showRequest(decodeURIComponent(tr.dataset.id), true); }
});

let detailBusy = false, detailFinal = false;
async function showRequest(id, fresh) {
  if (detailBusy && !fresh) return;
  selected = id; detailBusy = true;
  try {
    const d = await api("/dashboard/api/requests/" + encodeURIComponent(id));
    $("request-detail").hidden = false;
    const gaps = d.tokens.map((t, i) => (i === 0 ? t[0] : t[0] - d.tokens[i - 1][0]) * 1000);
    $("rd-title").textContent = `${id}: ${d.tokens.length} deltas; ms to first token, then between deltas`;
    barChart($("c-request"), gaps, "#3a78e8");
  } catch (e) {
    if (fresh) $("rd-title").textContent = `${id}: ${e.message}`;
  } finally { detailBusy = false; }
}

// `tokenmill plan`'s text, one block per line: a line too long for the panel wraps under itself (hanging
// indent) instead of running past the panel's edge
function renderPlan(text) {
  $("plan-text").innerHTML = text.split("\n").map((line) => {
    const indent = line.length - line.trimStart().length;
    return `<div style="padding-left:${indent + 4}ch;text-indent:-4ch">${esc(line.trimStart()) || "&nbsp;"}</div>`;
  }).join("");
}

async function loadConfig(batch) {
  try {
    const c = await api(`/dashboard/api/config?batch=${batch}`);
    $("t-config").tBodies[0].innerHTML = Object.entries(c.config).map(([k, v]) =>
      `<tr><td>${esc(k)}</td><td>${v === null ? "–" : esc(typeof v === "object" ? JSON.stringify(v) : v)}</td></tr>`).join("");
    renderPlan(c.plan.text);
  } catch (e) { console.warn("config:", e.message); }
}

// -- playground ---------------------------------------------------------------------------------------------
$("pg-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const out = $("pg-output"), statsEl = $("pg-stats");
  const body = { messages: [{ role: "user", content: $("pg-input").value }], stream: true,
    temperature: Number($("pg-temperature").value), top_p: Number($("pg-top-p").value),
    max_tokens: Number($("pg-max-tokens").value) };
  if ($("pg-seed").value !== "") body.seed = Number($("pg-seed").value);
  if (modelName) body.model = modelName;
  out.textContent = ""; $("pg-send").disabled = true;
  statsEl.textContent = "sampling: " + JSON.stringify({ temperature: body.temperature, top_p: body.top_p,
    max_tokens: body.max_tokens, seed: body.seed ?? null });
  const t0 = performance.now(); let last = t0; const gaps = [];
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...headers() } });
    if (!r.ok) { out.textContent = `HTTP ${r.status}: ${(await r.text()).slice(0, 300)}`; return; }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim(); buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        const text = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
        if (!text) continue;
        const now = performance.now(); gaps.push(now - last); last = now;
        const span = document.createElement("span");
        span.textContent = text; span.title = `${(gaps[gaps.length - 1]).toFixed(1)} ms`;
        out.appendChild(span);
      }
    }
    const total = (last - t0) / 1000;
    statsEl.textContent += ` · TTFT ${fmt(gaps[0] || 0)} ms · ${gaps.length} deltas in ${fmt(total, 2)} s` +
      (gaps.length > 1 ? ` · ${fmt((gaps.length - 1) / ((last - t0 - gaps[0]) / 1000))} tok/s after the first` : "") +
      " · hover a piece of text for its latency; bars: ms per delta";
    barChart($("c-playground"), gaps, "#8e5bd6");
  } catch (e) {
    out.textContent += `\n[error: ${e.message}]`;
  } finally { $("pg-send").disabled = false; }
});

// -- router view --------------------------------------------------------------------------------------------
const rhist = { load: {}, routed: {} };
let lastRouted = null;

function renderRouter(s) {
  const reps = s.replicas || [];
  $("r-healthy").textContent = `${reps.filter((r) => r.healthy).length} / ${reps.length}`;
  $("r-requests").textContent = reps.reduce((a, r) => a + r.requests, 0);
  $("r-retries").textContent = reps.reduce((a, r) => a + r.retries, 0);
  $("r-cut").textContent = reps.reduce((a, r) => a + r.stream_failures, 0);
  $("r-unrouted").textContent = s.unrouted;
  $("r-policy").textContent = `policy: ${s.policy}`;
  $("t-replicas").tBodies[0].innerHTML = reps.map((r) => `<tr><td>${esc(r.url)}</td><td>${r.healthy ? "yes" : "NO"}</td>` +
    `<td>${fmt(r.load)}</td><td>${r.in_flight}</td><td>${fmt(r.running, 0)}</td><td>${fmt(r.waiting, 0)}</td>` +
    `<td>${pct(r.kv_usage)}</td><td>${r.requests}</td><td>${pct(r.estimated_hit_rate)}</td>` +
    `<td>${r.cached_tokens} / ${r.prompt_tokens}</td><td>${r.retries}</td><td>${esc(r.last_error || "")}</td></tr>`).join("");
  const dt = lastRouted ? (s.t - lastRouted.t) : 0;
  reps.forEach((r) => {
    (rhist.load[r.url] = rhist.load[r.url] || []);
    push(rhist.load[r.url], r.load);
    (rhist.routed[r.url] = rhist.routed[r.url] || []);
    const before = lastRouted && lastRouted.counts[r.url];
    push(rhist.routed[r.url], dt > 0 && before !== undefined ? (r.requests - before) / dt : null);
  });
  lastRouted = { t: s.t, counts: Object.fromEntries(reps.map((r) => [r.url, r.requests])) };
  const series = (h) => reps.map((r, i) => ({ name: r.url, colour: COLOURS[i % COLOURS.length], values: h[r.url] }));
  lineChart($("c-load"), series(rhist.load), $("l-load"));
  lineChart($("c-decisions"), series(rhist.routed), $("l-decisions"));
}

// -- start ----------------------------------------------------------------------------------------------
let modelName = null;
async function start() {
  $("key-form").hidden = true;
  let info;
  try {
    info = await api("/dashboard/api/info");
  } catch (e) {
    if (e.status === 401) { askKey(apiKey ? "the key was refused" : ""); return; }
    $("status").textContent = "unreachable"; $("status").className = "pill down";
    setTimeout(start, 3000);
    return;
  }
  const router = info.kind === "router";
  modelName = info.model || null;
  $("title").textContent = router ? `router (${info.replicas} replicas)` : `${info.model} · v${info.version}`;
  // the panels stay hidden behind "waiting for the first snapshot" until there is something to put in them
  const view = router ? $("router-view") : $("engine-view"), render = router ? renderRouter : renderEngine;
  $("first-snapshot").hidden = false;
  stream((snap) => {
    if (view.hidden) { $("first-snapshot").hidden = true; view.hidden = false; }
    render(snap);
  });
}

start();
