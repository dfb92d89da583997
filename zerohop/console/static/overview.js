// zerohop console, the overview: this replica's live load, polled every second.
// Runs after console.js (its helpers are globals of the page).
"use strict";

const LIVE_URL = "/v1/admin/live?seconds=900";
const MAX_POINTS = 900;
const SERIES = ["t", "requests_per_s", "refusals_per_s", "output_tokens_per_s",
  "input_tokens_per_s", "running", "waiting", "kv_cache_use", "prefix_hit_rate",
  "ttft_p50", "ttft_p95", "itl_p50", "itl_p95"];
const last = (values) => (values && values.length ? values[values.length - 1] : null);
const scaled = (values, k) => (values || []).map((v) => (missing(v) ? null : v * k));
const fmtMs = (v) => fmtSeconds(v === null ? null : v / 1000);
const fmtPercent = (v) => (v === null ? "–" : `${v.toFixed(1)}%`);
const mean = (values) => (values.length
  ? values.reduce((sum, v) => sum + (v || 0), 0) / values.length : null);

function overviewCharts() {
  const tokenAxis = { scale: "tok", side: 1, label: "tokens/s", size: 60, grid: { show: false } };
  return {
    throughput: makeChart($("#chart-throughput"), [
      { label: "requests/s", value: fmtRate },
      { label: "refusals/s", value: fmtRate, color: "#c0392b" },
      { label: "output tokens/s", scale: "tok", value: fmtRate, color: "#27ae60" },
      { label: "input tokens/s", scale: "tok", value: fmtRate, color: "#8e44ad" },
    ], [{ label: "requests/s", size: 55 }, tokenAxis]),
    queue: makeChart($("#chart-queue"), [
      { label: "running", value: fmtInt },
      { label: "waiting", value: fmtInt, color: "#e67e22" },
    ], [{ label: "requests", size: 55 }]),
    cache: makeChart($("#chart-cache"), [
      { label: "KV cache use %", value: fmtPercent },
      { label: "prefix-cache hits %", value: fmtPercent, color: "#27ae60" },
    ], [{ label: "%", size: 55 }], { y: { range: [0, 100] } }),
    latency: makeChart($("#chart-latency"), [
      { label: "TTFT p50", value: fmtMs },
      { label: "TTFT p95", value: fmtMs, color: COLORS[0], dash: [6, 4] },
      { label: "ITL p50", value: fmtMs, color: "#27ae60" },
      { label: "ITL p95", value: fmtMs, color: "#27ae60", dash: [6, 4] },
    ], [{ label: "ms", size: 55 }]),
  };
}

// The headline numbers: the latest second's, and the last 15 minutes' summary.
function renderStats(live) {
  const summary = live.summary || {};
  const stats = {
    "#stat-requests-per-s": fmtRate(last(live.requests_per_s)),
    "#stat-output-tokens-per-s": fmtRate(last(live.output_tokens_per_s)),
    "#stat-input-tokens-per-s": fmtRate(last(live.input_tokens_per_s)),
    "#stat-refusals-per-s": fmtRate(last(live.refusals_per_s)),
    "#stat-running": fmtInt(last(live.running)),
    "#stat-waiting": fmtInt(last(live.waiting)),
    "#stat-kv-cache": fmtPct(last(live.kv_cache_use)),
    "#stat-prefix-hit": fmtPct(last(live.prefix_hit_rate)),
    "#stat-requests": fmtInt(summary.requests),
    "#stat-output-tokens": fmtInt(summary.output_tokens),
    "#stat-ttft-p50": fmtSeconds(summary.ttft_p50),
    "#stat-ttft-p95": fmtSeconds(summary.ttft_p95),
    "#stat-itl-p50": fmtSeconds(summary.itl_p50),
    "#stat-itl-p95": fmtSeconds(summary.itl_p95),
    "#live-updated": `Updated ${fmtTime(last(live.t))}.`,
  };
  for (const [id, text] of Object.entries(stats)) $(id).textContent = text;
}

// The points after the last one held, added to it (the server sends only those: the first
// answer is the whole 15 minutes, each later one a second or two), the oldest dropped.
function merge(state, delta) {
  if (!state) return delta;
  const before = state.t.length;
  const added = (delta.t || []).length;
  for (const key of SERIES) state[key] = state[key].concat(delta[key] || []);
  const names = new Set([...Object.keys(state.tenants), ...Object.keys(delta.tenants || {})]);
  const drop = Math.max(0, state.t.length - MAX_POINTS);
  const tenants = {};
  for (const name of names) {
    const old = state.tenants[name] || new Array(before).fill(0);
    const fresh = (delta.tenants || {})[name] || new Array(added).fill(0);
    const series = old.concat(fresh).slice(drop);
    if (series.some((v) => v > 0)) tenants[name] = series;
  }
  if (drop) for (const key of SERIES) state[key] = state[key].slice(drop);
  state.tenants = tenants;
  state.summary = delta.summary;
  return state;
}

function overviewPage() {
  const charts = overviewCharts();

  function render(live) {
    renderStats(live);
    const t = live.t || [];
    charts.throughput.setData([t, live.requests_per_s, live.refusals_per_s,
      live.output_tokens_per_s, live.input_tokens_per_s]);
    charts.queue.setData([t, live.running, live.waiting]);
    charts.cache.setData([t, scaled(live.kv_cache_use, 100), scaled(live.prefix_hit_rate, 100)]);
    charts.latency.setData([t, scaled(live.ttft_p50, 1000), scaled(live.ttft_p95, 1000),
      scaled(live.itl_p50, 1000), scaled(live.itl_p95, 1000)]);
    const tenants = Object.entries(live.tenants || {}).sort(([a], [b]) => a.localeCompare(b));
    const rows = tenants.map(([name, rates]) => el("tr", { "data-tenant": name },
      cell(name), num(fmtRate(last(rates))), num(fmtRate(mean(rates)))));
    fillTable($("#live-tenants"), rows, "No tenant has used the model in the last 15 minutes.");
  }

  // Every second, one request at a time (a slow answer delays the next, never piles up).
  let state = null;
  async function poll() {
    const started = performance.now();
    try {
      const newest = state ? last(state.t) : null;
      const url = newest === null ? LIVE_URL : `${LIVE_URL}&since=${newest}`;
      state = merge(state, await api("GET", url));
      render(state);
      clearError();
    } catch (error) {
      showError(error);
    }
    setTimeout(poll, Math.max(0, 1000 - (performance.now() - started)));
  }
  poll();
}

overviewPage();
