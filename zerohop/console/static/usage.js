// zerohop console, usage: tokens per tenant and key per day or month, per end user where a
// trusted front names them (the report's end_user "" is the rest), budgets' burn-down.
// Runs after console.js (its helpers are globals of the page).
"use strict";

const DAY = 86400;

async function usageReport(since) {
  const base = "/v1/organizations/usage_report/messages?bucket_width=1d&group_by[]=workspace_id"
    + "&group_by[]=api_key_id&group_by[]=end_user"
    + `&starting_at=${encodeURIComponent(since.toISOString())}&limit=31`;
  const buckets = [];
  let page = null;
  do {
    const answer = await api("GET", page ? `${base}&page=${encodeURIComponent(page)}` : base);
    buckets.push(...answer.data);
    page = answer.has_more ? answer.next_page : null;
  } while (page);
  return buckets.flatMap((bucket) => bucket.results.map((r) => ({
    start: toDate(bucket.starting_at),
    tenant: r.workspace_id,
    key: r.api_key_id,
    endUser: r.zerohop?.end_user || "",
    uncached: r.uncached_input_tokens || 0,
    cacheRead: r.cache_read_input_tokens || 0,
    output: r.output_tokens || 0,
  })));
}

// Sum `rows` by the key `by(row)` gives; [key, totals] sorted by key.
function sumBy(rows, by) {
  const groups = new Map();
  for (const row of rows) {
    const key = by(row);
    const total = groups.get(key) || { uncached: 0, cacheRead: 0, output: 0 };
    total.uncached += row.uncached;
    total.cacheRead += row.cacheRead;
    total.output += row.output;
    groups.set(key, total);
  }
  return [...groups.entries()].sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
}

// A usage row's numbers; the last is what budgets count (uncached input + output).
const usageCells = (t) => [num(fmtInt(t.uncached)), num(fmtInt(t.cacheRead)),
  num(fmtInt(t.output)), num(fmtInt(t.uncached + t.output))];
const seconds = (t) => toDate(t).getTime() / 1000;

// The burn-down of one budget: its use so far this period (from the daily usage, ending at
// `used` now), the projection at the last hour's rate, and the budget's line.
function burndownData(budget, rows) {
  const now = Date.now() / 1000;
  const [kind, ...rest] = budget.subject.split(":");
  const name = rest.join(":");
  const ends = budget.period_ends_at ? seconds(budget.period_ends_at) : null;
  let start = now - 30 * DAY;
  if (budget.period === "day" && ends) start = ends - DAY;
  if (budget.period === "month" && ends) {
    const first = new Date((ends - 1) * 1000);
    start = Date.UTC(first.getUTCFullYear(), first.getUTCMonth(), 1) / 1000;
  }
  const mine = rows.filter((r) => (kind === "key" ? r.key === name : r.tenant === name)
    && seconds(r.start) >= start - 1);
  const days = sumBy(mine, (r) => seconds(r.start)).map(([t, s]) => [t, s.uncached + s.output]);
  const points = [[start, budget.used - days.reduce((sum, [, v]) => sum + v, 0)]];
  let running = points[0][1];
  for (const [t, v] of days) {
    running += v;
    points.push([Math.min(t + DAY, now), running]);
  }
  // The projection ends where the budget runs out, or at the period's end; the chart shows
  // the whole period (a week ahead for a budget in total).
  const runsOut = budget.runs_out_at ? seconds(budget.runs_out_at) : null;
  const last = Math.max(ends || 0, runsOut || 0) || now + 7 * DAY;
  const stop = runsOut && (!ends || runsOut < ends) ? runsOut : last;
  const rate = (budget.burn_per_hour || 0) / 3600;
  const projected = Math.min(budget.tokens, budget.used + rate * (stop - now));
  const xs = [...new Set([...points.map(([t]) => t), now, stop, last])].sort((a, b) => a - b);
  const usedAt = new Map(points.map(([t, v]) => [t, Math.max(v, 0)]));
  usedAt.set(now, budget.used);
  return [
    xs,
    xs.map((t) => (usedAt.has(t) ? usedAt.get(t) : null)),
    xs.map((t) => (t === now ? budget.used : t === stop ? projected : null)),
    xs.map(() => budget.tokens),
  ];
}

function budgetRow(b) {
  return el("tr", { "data-subject": b.subject },
    cell(b.subject), cell(b.period), num(fmtInt(b.tokens)), num(fmtInt(b.used)),
    num(fmtInt(b.remaining)), num(fmtRate(b.burn_per_hour)), cell(fmtTime(b.period_ends_at, false)),
    cell(b.runs_out_at ? fmtTime(b.runs_out_at, false) : "not this period"));
}

function usagePage() {
  const since = new Date();
  since.setUTCHours(0, 0, 0, 0);
  since.setUTCDate(since.getUTCDate() - 30);
  let rows = [];
  let budgets = [];
  let chart = null;

  function renderUsage() {
    const month = $("#usage-view").value === "month";
    const period = (r) => r.start.toISOString().slice(0, month ? 7 : 10);
    const grouped = sumBy(rows, (r) => JSON.stringify([period(r), r.tenant, r.key]))
      .filter(([, t]) => t.uncached + t.cacheRead + t.output > 0).reverse();
    fillTable($("#usage-table"), grouped.map(([key, totals]) => {
      const [when, tenant, apiKey] = JSON.parse(key);
      return el("tr", { "data-key": apiKey }, cell(when), cell(tenant), codeCell(apiKey),
        ...usageCells(totals));
    }), "No use in the last 30 days.");
    const perTenant = sumBy(rows, (r) => r.tenant ?? "–").map(([tenant, totals]) =>
      el("tr", { "data-tenant": tenant }, cell(tenant), ...usageCells(totals)));
    fillTable($("#usage-totals"), perTenant, "No use in the last 30 days.");
    // Shown once a trusted front has named someone; unnamed use stays in the tables above.
    const named = sumBy(rows.filter((r) => r.endUser),
      (r) => JSON.stringify([period(r), r.endUser, r.key])).reverse();
    $("#usage-end-users").hidden = named.length === 0;
    fillTable($("#usage-end-users"), named.map(([key, totals]) => {
      const [when, endUser, apiKey] = JSON.parse(key);
      return el("tr", { "data-end-user": endUser }, cell(when), cell(endUser), codeCell(apiKey),
        ...usageCells(totals));
    }), "");
  }

  function renderBurndown() {
    const budget = budgets[Number($("#budget-select").value)];
    $("#burndown").hidden = !budget;
    if (!budget) return;
    $("#budget-runs-out").textContent = budget.runs_out_at
      ? `runs out ${fmtTime(budget.runs_out_at, false)} at the last hour's rate`
      : "does not run out this period at the last hour's rate";
    const data = burndownData(budget, rows);
    if (!chart) {
      chart = makeChart($("#chart-burndown"), [
        { label: "used", value: fmtInt },
        { label: "projected", value: fmtInt, dash: [6, 4] },
        { label: "budget", value: fmtInt, color: "#c0392b" },
      ], [{ label: "tokens", size: 70 }]);
    }
    chart.setData(data);
  }

  // The 30 days once a minute; in between, only today's bucket (the one that moves).
  let wholeAt = 0;
  async function load() {
    const today = new Date();
    today.setUTCHours(0, 0, 0, 0);
    const whole = Date.now() - wholeAt > 60000;
    const [usage, answer] = await Promise.all([
      usageReport(whole ? since : today),
      api("GET", "/v1/admin/budgets"),
    ]);
    if (whole) wholeAt = Date.now();
    rows = whole ? usage : rows.filter((r) => r.start < today).concat(usage);
    budgets = answer.data;
    renderUsage();
    fillTable($("#budgets-table"), budgets.map(budgetRow), "No budgets.");
    const select = $("#budget-select");
    const chosen = select.value;
    select.replaceChildren(...budgets.map((b, i) =>
      el("option", { value: i, text: `${b.subject} (${b.period})` })));
    if (chosen && Number(chosen) < budgets.length) select.value = chosen;
    renderBurndown();
  }

  $("#usage-view").addEventListener("change", renderUsage);
  $("#budget-select").addEventListener("change", renderBurndown);
  // Every second (use reaches the store within about a second), one load at a time: a slow
  // answer delays the next, never piles up behind it.
  async function refresh() {
    const started = performance.now();
    await load().then(clearError, showError);
    setTimeout(refresh, Math.max(0, 1000 - (performance.now() - started)));
  }
  refresh();
}

usagePage();
