// zerohop console, refusals: by reason, with the limit that refused.
// Runs after console.js (its helpers are globals of the page).
"use strict";

function refusalsPage() {
  async function load() {
    const since = new Date(Date.now() - Number($("#refusals-range").value) * 1000);
    const query = `starting_at=${encodeURIComponent(since.toISOString())}`;
    const answer = await api("GET", `/v1/admin/refusals?${query}`);
    const rows = answer.data.map((r) => el("tr", {},
      cell(r.reason), codeCell(r.api_key_id), cell(r.workspace_id), num(fmtInt(r.count)),
      cell(r.last_message), cell(fmtTime(r.last_at))));
    fillTable($("#refusals-table"), rows, "No refusals in this time.");
  }

  const refresh = () => load().then(clearError, showError);
  $("#refusals-range").addEventListener("change", refresh);
  $("#refusals-refresh").addEventListener("click", refresh);
  refresh();
}

refusalsPage();
