// zerohop console: what every page shares (the admin API, elements, formats, forms, charts).
// Each page's own script (overview.js, tenants.js, ...) runs after this one and fills the
// server's page shell from the admin API (docs/admin-api.md).
//
// Plain ES2020, no framework, no build step. Runs under the console's CSP: no inline
// script or style, no eval; data is put in the page with textContent only.
"use strict";

// -- the admin API ---------------------------------------------------------------------------

const CSRF = document.querySelector('meta[name="csrf-token"]')?.content ?? "";

class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

// A call to the admin API with the session cookie; every change carries the CSRF token.
async function api(method, path, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (method !== "GET" && method !== "HEAD") init.headers["x-csrf-token"] = CSRF;
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    if (response.status === 401) location.assign("/console/login"); // the session is over
    const error = (data && data.error) || {};
    throw new ApiError(response.status, error.type || "api_error",
      error.message || `${method} ${path}: HTTP ${response.status}`);
  }
  return data;
}

// -- the page: banners, elements, formats ----------------------------------------------------

const $ = (selector) => document.querySelector(selector);
const missing = (v) => v === null || v === undefined;

function showError(error) {
  const banner = $("#error");
  banner.textContent = error instanceof Error ? error.message : String(error);
  banner.hidden = false;
}

function clearError() {
  $("#error").hidden = true;
}

function notice(message) {
  const banner = $("#notice");
  banner.textContent = message;
  banner.hidden = false;
}

// An element: props are attributes, except text, className and on* (listeners); children
// are nodes or strings (text nodes, never parsed as HTML).
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (missing(value) || value === false) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "className") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (!missing(child)) node.append(child);
  }
  return node;
}

const cell = (value, className) => el("td", { className, text: value ?? "–" });
const num = (value) => cell(value, "num");
const codeCell = (value) => el("td", {}, el("code", { text: value ?? "–" }));

function fillTable(table, rows, empty) {
  const tbody = table.tBodies[0];
  const columns = table.tHead.rows[0].cells.length;
  tbody.replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", { className: "empty", colspan: columns, text: empty }))]));
}

const fmtInt = (n) => (missing(n) ? "–" : Math.round(n).toLocaleString("en-US"));
const fmtRate = (n) => (missing(n) ? "–"
  : n < 10 ? n.toFixed(2) : n < 100 ? n.toFixed(1) : fmtInt(n));
const fmtPct = (x) => (missing(x) ? "–" : `${(x * 100).toFixed(1)}%`);

function fmtSeconds(s) {
  if (missing(s)) return "–";
  const ms = s * 1000;
  if (ms < 10) return `${ms.toFixed(2)} ms`;
  if (ms < 1000) return `${ms.toFixed(0)} ms`;
  return `${s.toFixed(2)} s`;
}

// RFC 3339 or unix seconds -> a Date (null for null).
const toDate = (t) => (missing(t) ? null : new Date(typeof t === "number" ? t * 1000 : t));

function fmtTime(t, withSeconds = true) {
  const date = toDate(t);
  if (!date || Number.isNaN(date.getTime())) return "–";
  return `${date.toISOString().slice(0, withSeconds ? 19 : 16).replace("T", " ")} UTC`;
}

const LIMITS = ["rpm", "itpm", "otpm", "max_concurrency"];

function fmtLimits(limits) {
  const set = LIMITS.filter((name) => limits && !missing(limits[name]));
  return set.length ? set.map((name) => `${name} ${fmtInt(limits[name])}`).join(" · ") : "–";
}

const fmtBudget = (budget) => (budget ? `${fmtInt(budget.tokens)} / ${budget.period}` : "–");

// -- forms -----------------------------------------------------------------------------------

const intOrNull = (input) => (input.value.trim() === "" ? null : Math.round(Number(input.value)));

// {rpm, itpm, otpm, max_concurrency} from a form's limit inputs (`#<prefix>-<name>`); an
// empty input is null (no limit).
function limitsFrom(form, prefix) {
  const value = (name) => intOrNull(form.querySelector(`#${prefix}-${name}`));
  return Object.fromEntries(LIMITS.map((name) => [name, value(name)]));
}

function budgetFrom(form, prefix) {
  const tokens = intOrNull(form.querySelector(`#${prefix}-budget-tokens`));
  const period = form.querySelector(`#${prefix}-budget-period`).value;
  return tokens === null ? null : { tokens, period };
}

function fillLimits(form, prefix, limits, budget) {
  for (const name of LIMITS) {
    const value = limits ? limits[name] : null;
    form.querySelector(`#${prefix}-${name}`).value = missing(value) ? "" : value;
  }
  form.querySelector(`#${prefix}-budget-tokens`).value = budget ? budget.tokens : "";
  form.querySelector(`#${prefix}-budget-period`).value = budget ? budget.period : "month";
}

// Run `action` for a form's submit: errors shown, the button disabled meanwhile.
function onSubmit(form, action) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = form.querySelector('button[type="submit"]');
    button.disabled = true;
    try {
      await action();
      clearError();
    } catch (error) {
      showError(error);
    } finally {
      button.disabled = false;
    }
  });
}

// -- charts (uPlot) --------------------------------------------------------------------------

const COLORS = ["#2f6fde", "#e67e22", "#27ae60", "#8e44ad", "#c0392b", "#16a085"];
const CHART_HEIGHT = 220;

// A uPlot chart in `box` that follows its width. series: [{label, scale?, dash?, color?,
// value?}]; axes: extra axes after x (uPlot's form).
function makeChart(box, series, axes, scales = {}) {
  const options = {
    width: Math.max(box.clientWidth, 300),
    height: CHART_HEIGHT,
    scales: { x: { time: true }, ...scales },
    series: [{}, ...series.map((s, i) => ({
      label: s.label,
      scale: s.scale || "y",
      stroke: s.color || COLORS[i % COLORS.length],
      width: 2,
      dash: s.dash,
      spanGaps: false,
      value: s.value ? (u, v) => s.value(v) : undefined,
    }))],
    axes: [{}, ...axes],
    legend: { live: true },
    cursor: { drag: { x: false, y: false } },
  };
  const chart = new uPlot(options, [[], ...series.map(() => [])], box);
  const fit = () => chart.setSize({ width: Math.max(box.clientWidth, 300), height: CHART_HEIGHT });
  new ResizeObserver(fit).observe(box);
  return chart;
}
