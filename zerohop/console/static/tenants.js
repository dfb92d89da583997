// zerohop console, tenants and keys: create, edit, revoke; a new key's secret shown once.
// Runs after console.js (its helpers are globals of the page).
"use strict";

function tenantsPage() {
  const tenantForm = $("#tenant-form");
  const keyForm = $("#key-form");
  const editForm = $("#key-edit-form");
  const showAll = $("#keys-show-all");
  let keys = [];

  function editTenant(tenant) {
    $("#tenant-name").value = tenant.name;
    $("#tenant-weight").value = tenant.weight;
    fillLimits(tenantForm, "tenant", tenant.limits, tenant.budget);
    tenantForm.scrollIntoView({ block: "nearest" });
  }

  function editKey(key) {
    const extra = key.zerohop || {};
    editForm.dataset.keyId = key.id;
    $("#edit-key-id").textContent = key.id;
    $("#edit-name").value = key.name || "";
    $("#edit-priority").value = extra.priority || "interactive";
    fillLimits(editForm, "edit", extra.limits, extra.budget);
    editForm.hidden = false;
    editForm.scrollIntoView({ block: "nearest" });
  }

  async function setStatus(key, status) {
    const revoke = status === "inactive";
    const own = key.id === $("#viewer-key").textContent ? " It is the key of this session." : "";
    if (revoke && !confirm(`Revoke key ${key.id}? Its requests are refused at once.${own}`)) return;
    try {
      await api("POST", `/v1/organizations/api_keys/${encodeURIComponent(key.id)}`, { status });
      notice(`${revoke ? "Revoked" : "Reactivated"} key ${key.id}.`);
      await load();
    } catch (error) {
      showError(error);
    }
  }

  function keyRow(key) {
    const extra = key.zerohop || {};
    const kind = [extra.admin && "admin", extra.inference !== false && "inference"]
      .filter(Boolean).join(" + ");
    const button = (text, onclick, className) =>
      el("button", { type: "button", text, onclick, className });
    const actions = el("div", { className: "actions" }, button("Edit", () => editKey(key)));
    if (key.status === "active") {
      actions.append(button("Revoke", () => setStatus(key, "inactive"), "danger"));
    } else if (key.status === "inactive") {
      actions.append(button("Reactivate", () => setStatus(key, "active")));
    }
    return el("tr", { className: key.status === "active" ? null : "inactive", "data-key": key.id },
      codeCell(key.id), cell(key.name || ""), cell(key.workspace_id), cell(key.status),
      cell(kind || "–"), cell(extra.priority), cell(fmtLimits(extra.limits)),
      cell(fmtBudget(extra.budget)), cell(fmtTime(key.created_at, false)), el("td", {}, actions));
  }

  function tenantRow(tenant) {
    const edit = el("button", { type: "button", text: "Edit", onclick: () => editTenant(tenant) });
    const problems = tenant.problems && tenant.problems.length
      ? el("div", { className: "status-bad", text: `invalid: ${tenant.problems.join("; ")}` })
      : null;
    return el("tr", { "data-tenant": tenant.name },
      el("td", {}, tenant.name, problems), num(tenant.weight), cell(fmtLimits(tenant.limits)),
      cell(fmtBudget(tenant.budget)), num(fmtInt(tenant.active_keys)), el("td", {}, edit));
  }

  function renderKeys() {
    const shown = showAll.checked ? keys : keys.filter((key) => key.status === "active");
    fillTable($("#keys-table"), shown.map(keyRow), "No keys.");
  }

  async function load() {
    const [tenants, keyPage] = await Promise.all([
      api("GET", "/v1/admin/tenants"),
      api("GET", "/v1/organizations/api_keys?limit=1000"),
    ]);
    keys = keyPage.data;
    fillTable($("#tenants-table"), tenants.data.map(tenantRow), "No tenants yet.");
    const names = tenants.data.map((tenant) => el("option", { value: tenant.name }));
    $("#tenant-names").replaceChildren(...names);
    renderKeys();
  }

  onSubmit(tenantForm, async () => {
    const name = $("#tenant-name").value.trim();
    const weight = $("#tenant-weight").value.trim();
    const body = {
      limits: limitsFrom(tenantForm, "tenant"),
      budget: budgetFrom(tenantForm, "tenant"),
    };
    if (weight !== "") body.weight = Number(weight);
    await api("PUT", `/v1/admin/tenants/${encodeURIComponent(name)}`, body);
    notice(`Saved tenant ${name}.`);
    tenantForm.reset();
    await load();
  });

  onSubmit(keyForm, async () => {
    const limits = Object.fromEntries(
      Object.entries(limitsFrom(keyForm, "key")).filter(([, v]) => v !== null));
    const models = $("#key-models").value.split(",").map((m) => m.trim()).filter(Boolean);
    const body = {
      tenant: $("#key-tenant").value.trim(),
      name: $("#key-name").value.trim(),
      priority: $("#key-priority").value,
      admin: $("#key-admin").checked,
      // A data-plane key calls the model; an admin key only when asked (the API's default).
      inference: !$("#key-admin").checked || $("#key-inference").checked,
    };
    if (models.length) body.models = models;
    if (Object.keys(limits).length) body.limits = limits;
    const budget = budgetFrom(keyForm, "key");
    if (budget) body.budget = budget;
    const created = await api("POST", "/v1/admin/keys", body);
    $("#new-secret").textContent = created.secret; // in this page's memory only: gone on reload
    $("#copy-status").textContent = "";
    $("#new-secret-box").hidden = false;
    notice(`Created key ${created.api_key.id} for tenant ${created.api_key.workspace_id}.`);
    keyForm.reset();
    await load();
  });

  onSubmit(editForm, async () => {
    const id = editForm.dataset.keyId;
    await api("POST", `/v1/admin/keys/${encodeURIComponent(id)}`, {
      name: $("#edit-name").value.trim(),
      priority: $("#edit-priority").value,
      limits: limitsFrom(editForm, "edit"),
      budget: budgetFrom(editForm, "edit"),
    });
    notice(`Saved key ${id}.`);
    editForm.hidden = true;
    await load();
  });

  $("#edit-cancel").addEventListener("click", () => {
    editForm.hidden = true;
  });
  showAll.addEventListener("change", renderKeys);
  $("#copy-secret").addEventListener("click", async () => {
    const status = $("#copy-status");
    try {
      await navigator.clipboard.writeText($("#new-secret").textContent);
      status.textContent = "Copied.";
    } catch {
      getSelection().selectAllChildren($("#new-secret")); // no clipboard (not a secure context)
      status.textContent = "Selected: copy it with Ctrl+C.";
    }
  });
  load().catch(showError);
}

tenantsPage();
