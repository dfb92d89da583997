// zerohop console, audit: search and page through the records, verify the chain.
// Runs after console.js (its helpers are globals of the page).
"use strict";

// One line on what a record is about: an admin action and its target, or a request (an
// admin-API or console request refused for who sent it names its path).
function auditSummary(record) {
  if (record.kind === "admin") return `${record.action ?? ""} ${record.target ?? ""}`.trim();
  // end_user: the user a trusted front (claude gateway, LiteLLM) named.
  const parts = [record.end_user_email ?? record.end_user, record.model, record.surface,
    record.path];
  if (record.input_tokens !== undefined) parts.push(`in ${fmtInt(record.input_tokens)}`);
  if (record.output_tokens !== undefined) parts.push(`out ${fmtInt(record.output_tokens)}`);
  if (record.error_type) parts.push(record.error_type);
  return parts.filter((p) => !missing(p)).join(" · ");
}

function auditRow(record) {
  const status = record.status ?? null;
  const details = el("details", {}, el("summary", { text: "record" }),
    el("pre", { text: JSON.stringify(record, null, 2) }));
  return el("tr", { "data-seq": record.seq },
    num(record.seq), cell(fmtTime(record.time)), cell(record.kind || "request"),
    codeCell(record.key_id ?? record.actor), cell(record.tenant),
    cell(status, status >= 400 ? "status-bad" : null), cell(auditSummary(record)),
    el("td", {}, details));
}

function verifyText(v) {
  const notes = [v.torn && "a torn last line", v.truncated && "truncated"].filter(Boolean);
  const extra = notes.length ? `; ${notes.join(", ")}` : "";
  return v.ok
    ? `Chain intact: ${fmtInt(v.records)} records in ${fmtInt(v.files)} files${extra}.`
    : `Chain broken at record ${v.first_broken} (${fmtInt(v.records)} records read${extra}).`;
}

function auditPage() {
  const form = $("#audit-form");
  const older = $("#audit-older");
  let nextBefore = null;

  // The search as the API's query: empty fields left out, local times sent in UTC.
  function query(before) {
    const params = new URLSearchParams({ limit: "50" });
    for (const [name, value] of new FormData(form)) {
      const text = String(value).trim();
      if (!text) continue;
      params.set(name, name.endsWith("_at") ? new Date(text).toISOString() : text);
    }
    if (before !== null) params.set("before", before);
    return `/v1/admin/audit?${params}`;
  }

  async function load(before) {
    const answer = await api("GET", query(before));
    fillTable($("#audit-table"), answer.data.map(auditRow), "No records match.");
    nextBefore = answer.has_more ? answer.next_before : null;
    older.disabled = nextBefore === null;
  }

  const run = (before) => load(before).then(clearError, showError);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    run(null);
  });
  $("#audit-newest").addEventListener("click", () => run(null));
  older.addEventListener("click", () => run(nextBefore));
  $("#audit-verify").addEventListener("click", async () => {
    const out = $("#audit-verify-result");
    out.className = "";
    out.textContent = "Verifying…";
    try {
      const verdict = await api("POST", "/v1/admin/audit/verify");
      out.textContent = verifyText(verdict);
      out.className = verdict.ok ? "ok" : "broken";
    } catch (error) {
      out.textContent = "";
      showError(error);
    }
  });
  run(null);
}

auditPage();
