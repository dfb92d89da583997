"""The admin API (docs/admin-api.md) on a real `zerohop serve`: admin keys, Anthropic's API
keys routes through the official SDK, the usage and refusals reports moving as requests are
served, tenants, budgets, the audit log and live load; and who is refused where."""

from __future__ import annotations

import time
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_gateway_auth import cli_json, headers_for, poll
from zerohop.admin.views import ROUTES


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict:
    db = tmp_path_factory.mktemp("admin_keys") / "keys.db"

    def create(*flags: str) -> dict:
        return cli_json("keys", "create", "--keys-db", db, *flags)

    made = {
        "admin": create("--tenant", "ops", "--name", "root", "--admin"),
        "both": create("--tenant", "ops", "--admin", "--inference"),
        "data": create("--tenant", "acme", "--name", "app", "--budget", "100000/month"),
    }
    return {"db": db, **{name: rec["key"] for name, rec in made.items()},
            "ids": {name: rec["key_id"] for name, rec in made.items()}}  # fmt: skip


@pytest.fixture(scope="module")
def server(llama_dir: Path, keys: dict, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("admin_server") / "server.log"
    srv = LiveServer(llama_dir, ["--keys-db", str(keys["db"])]).start(log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def admin(server: LiveServer, keys: dict):
    with httpx.Client(base_url=server.url, headers=headers_for(keys["admin"]), timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(server: LiveServer, keys: dict) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=keys["admin"], base_url=server.url, max_retries=0)


def message(server: LiveServer, key: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there"}]}  # fmt: skip
    return httpx.post(server.url + "/v1/messages", json=body, headers=headers_for(key), timeout=60)


def filled(path: str) -> str:
    return path.replace("{id}", "zh-nothing1").replace("{name}", "acme")


def test_data_plane_keys_are_forbidden_and_a_missing_key_unauthenticated(server, keys):
    for method, path, _ in ROUTES:
        url = server.url + filled(path)
        data = httpx.request(method, url, headers=headers_for(keys["data"]), json={})
        assert data.status_code == 403, (method, path, data.text)
        assert data.json()["error"]["type"] == "permission_error"
        none = httpx.request(method, url, json={})
        assert none.status_code == 401, (method, path)
        assert none.json()["error"]["type"] == "authentication_error"
        wrong = httpx.request(method, url, headers=headers_for("zh-" + "x" * 43), json={})
        assert wrong.status_code == 401, (method, path)


def test_an_admin_key_cannot_call_the_model_unless_made_so(server, keys):
    refused = message(server, keys["admin"])
    assert refused.status_code == 403
    assert "admin key" in refused.json()["error"]["message"]
    assert message(server, keys["both"]).status_code == 200
    assert message(server, keys["data"]).status_code == 200


def test_the_sdk_lists_pages_retrieves_and_updates_api_keys(sdk, keys):
    listed = sdk.beta.organization.api_keys.list(limit=1000)
    ids = [k.id for k in listed.data]
    assert set(keys["ids"].values()) <= set(ids)
    paged = [k.id for k in sdk.beta.organization.api_keys.list(limit=1)]  # auto-paging
    assert paged == ids
    one = sdk.beta.organization.api_keys.retrieve(keys["ids"]["data"])
    assert (one.name, one.status, one.scope.workspace_id) == ("app", "active", "acme")
    renamed = sdk.beta.organization.api_keys.update(keys["ids"]["data"], name="app-2")
    assert renamed.name == "app-2"
    only_ops = sdk.beta.organization.api_keys.list(workspace_id="ops", limit=1000)
    assert {k.id for k in only_ops.data} == {keys["ids"]["admin"], keys["ids"]["both"]}
    with pytest.raises(anthropic.NotFoundError):
        sdk.beta.organization.api_keys.retrieve("zh-nothing1")


def test_a_created_key_works_its_usage_is_reported_and_revoking_stops_it(server, admin, sdk):
    made = admin.post("/v1/admin/keys", json={"tenant": "team-new", "name": "svc"})
    assert made.status_code == 201, made.text
    secret, key_id = made.json()["secret"], made.json()["api_key"]["id"]
    assert secret.startswith(key_id)
    assert admin.get(f"/v1/organizations/api_keys/{key_id}").json()["created_by"]["id"]
    answered = message(server, secret, max_tokens=5)
    assert answered.status_code == 200
    output_tokens = answered.json()["usage"]["output_tokens"]  # sampled: may end before 5
    start = time.strftime("%Y-%m-%dT00:00:00Z", time.gmtime())

    def reported() -> list:
        report = sdk.get(
            "/v1/organizations/usage_report/messages",
            cast_to=object,
            options={"params": {"starting_at": start, "group_by": ["api_key_id", "model"],
                                "api_key_ids": [key_id]}},  # sent as group_by[]=...
        )  # fmt: skip
        return [r for bucket in report["data"] for r in bucket["results"]]

    poll(lambda: bool(reported()), timeout=5)
    (row,) = reported()
    assert (row["api_key_id"], row["model"], row["workspace_id"]) == (key_id, MODEL_NAME, None)
    assert row["output_tokens"] == output_tokens and row["uncached_input_tokens"] > 0
    revoked = sdk.beta.organization.api_keys.update(key_id, status="inactive")
    assert revoked.status == "inactive"
    assert message(server, secret).status_code == 401  # at once: the update waits for it
    assert sdk.beta.organization.api_keys.update(key_id, status="active").status == "active"
    assert message(server, secret).status_code == 200
    archived = admin.post(f"/v1/organizations/api_keys/{key_id}", json={"status": "archived"})
    assert archived.json()["status"] == "archived"
    again = admin.post(f"/v1/organizations/api_keys/{key_id}", json={"status": "active"})
    assert again.status_code == 400 and "archived" in again.json()["error"]["message"]
    assert message(server, secret).status_code == 401


def test_tenants_are_created_updated_and_checked(admin):
    put = admin.put("/v1/admin/tenants/team-b", json={"weight": 2, "limits": {"rpm": 60}})
    assert put.status_code == 200, put.text
    assert put.json() == {"name": "team-b", "weight": 2.0, "active_keys": 0, "problems": [],
                          "budget": None, "limits": {"rpm": 60, "itpm": None, "otpm": None,
                                                     "max_concurrency": None}}  # fmt: skip
    merged = admin.put("/v1/admin/tenants/team-b", json={"limits": {"otpm": 1000, "rpm": None}})
    assert merged.json()["limits"] == {"rpm": None, "itpm": None, "otpm": 1000,
                                       "max_concurrency": None}  # fmt: skip
    assert merged.json()["weight"] == 2.0
    names = [t["name"] for t in admin.get("/v1/admin/tenants").json()["data"]]
    assert {"acme", "ops", "team-b"} <= set(names)
    for body, field in (({"weight": -1}, "weight"), ({"limits": {"rpm": -5}}, "limits.rpm"),
                        ({"budget": {"tokens": 0}}, "budget.tokens"), ({"nope": 1}, "nope"),
                        ({"limits": {"tpm": 1}}, "tpm")):  # fmt: skip
        bad = admin.put("/v1/admin/tenants/team-b", json=body)
        assert bad.status_code == 400, body
        assert field in bad.json()["error"]["message"]
    assert admin.put("/v1/admin/tenants/team-b", content=b"[1,").status_code == 400
    assert admin.get("/v1/admin/tenants/nobody").status_code == 404


def test_a_refusal_is_reported_with_the_limit_that_refused(server, admin):
    made = admin.post("/v1/admin/keys", json={"tenant": "acme", "limits": {"rpm": 0}}).json()
    assert message(server, made["secret"]).status_code == 429

    def refusals() -> list:
        rows = admin.get("/v1/admin/refusals").json()["data"]
        return [r for r in rows if r["api_key_id"] == made["api_key"]["id"]]

    poll(lambda: bool(refusals()), timeout=5)
    (row,) = refusals()
    assert (row["reason"], row["count"], row["workspace_id"]) == ("rate_limit_requests", 1, "acme")
    assert "rpm limit is 0" in row["last_message"]


def test_budgets_show_what_is_used_and_what_remains(server, admin, keys):
    assert message(server, keys["data"], max_tokens=3).status_code == 200

    def mine() -> dict:
        rows = admin.get("/v1/admin/budgets").json()["data"]
        return next(r for r in rows if r["subject"] == f"key:{keys['ids']['data']}")

    poll(lambda: mine()["burn_per_hour"] > 0, timeout=5)
    row = mine()
    assert (row["tokens"], row["period"]) == (100000, "month")
    assert row["used"] > 0 and row["remaining"] == 100000 - row["used"]
    assert row["period_ends_at"].endswith("-01T00:00:00Z")


def test_admin_actions_are_audited_and_the_log_verifies(server, admin, keys):
    admin.put("/v1/admin/tenants/audited", json={"weight": 3})
    assert message(server, keys["data"]).status_code == 200

    def search(**params) -> list:  # the log is written every 0.2 s, off the request path
        return admin.get("/v1/admin/audit", params=params).json()["data"]

    poll(lambda: bool(search(api_key_id=keys["ids"]["data"])), timeout=5)
    poll(lambda: any(r["target"] == "audited" for r in search(kind="admin")), timeout=5)
    page = admin.get("/v1/admin/audit", params={"kind": "admin", "limit": 1000}).json()
    actions = [(r["action"], r["target"]) for r in page["data"]]
    assert ("tenant.update", "audited") in actions
    record = next(r for r in page["data"] if r["target"] == "audited")
    assert record["actor"] == keys["ids"]["admin"] and record["before"] is None
    assert record["after"]["weight"] == 3.0
    requests = admin.get("/v1/admin/audit", params={"api_key_id": keys["ids"]["data"]}).json()
    assert requests["data"] and all(r["key_id"] == keys["ids"]["data"] for r in requests["data"])
    bad = admin.get("/v1/admin/audit", params={"status": "6xx"})
    assert bad.status_code == 400
    verified = admin.post("/v1/admin/audit/verify").json()
    assert verified["ok"] and verified["records"] > 0


def test_live_load_moves_with_the_requests(server, admin, keys):
    for _ in range(2):
        assert message(server, keys["data"], max_tokens=4).status_code == 200

    def served() -> float:
        live = admin.get("/v1/admin/live", params={"seconds": 30}).json()
        return sum(live["output_tokens_per_s"])

    poll(lambda: served() > 0, timeout=5)
    assert admin.get("/v1/admin/live", params={"seconds": 0}).status_code == 400


def test_batches_of_every_tenant_are_listed(server, admin, keys):
    client = anthropic.Anthropic(api_key=keys["data"], base_url=server.url, max_retries=0)
    params = {"model": MODEL_NAME, "max_tokens": 2,
              "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    batch = client.messages.batches.create(requests=[{"custom_id": "a", "params": params}])
    listed = admin.get("/v1/admin/batches", params={"workspace_id": "acme"}).json()["data"]
    mine = next(b for b in listed if b["id"] == batch.id)
    assert (mine["api"], mine["api_key_id"], mine["workspace_id"]) == (
        "anthropic", keys["ids"]["data"], "acme")  # fmt: skip
    assert admin.get("/v1/admin/batches", params={"workspace_id": "nobody"}).json()["data"] == []


def test_bad_values_are_refused_where_they_enter_never_with_a_500(admin):
    bad = [
        ("POST", "/v1/admin/keys", {"tenant": "t", "expires_at": 1e12}, "expires_at"),
        ("POST", "/v1/admin/keys", {"tenant": "t", "expires_at": "10000-01-01"}, "expires_at"),
        ("POST", "/v1/admin/keys", {"tenant": "t", "budget": {"tokens": 2**64 - 1}}, "tokens"),
        ("POST", "/v1/admin/keys", {"tenant": "t\x00x"}, "tenant"),
        ("POST", "/v1/admin/keys", {"tenant": "t", "admin": "yes"}, "admin"),
        ("PUT", "/v1/admin/tenants/x", {"limits": {"rpm": 2**63}}, "limits.rpm"),
        ("GET", "/v1/admin/live?seconds=1&seconds=2", None, "seconds"),
        ("GET", "/v1/organizations/api_keys?limit=5&limit=6", None, "limit"),
        ("GET", "/v1/organizations/api_keys?limit=" + "9" * 5000, None, "limit"),
        ("GET", "/v1/admin/refusals?starting_at=1e300", None, "starting_at"),
        ("GET", "/v1/admin/refusals?starting_at=100&ending_at=50", None, "ending_at"),
        ("GET", "/v1/organizations/usage_report/messages?starting_at=1e300", None, "starting_at"),
        ("GET", "/v1/organizations/usage_report/messages?starting_at=0001-01-01T00:00:00%2B01:00",
         None, "starting_at"),
        ("GET", "/v1/admin/audit?limit=" + "9" * 5000, None, "limit"),
        ("POST", "/v1/admin/keys/zh-nothing1", {"name": "x"}, "no API key"),
    ]  # fmt: skip
    for method, path, body, field in bad:
        answer = admin.request(method, path, json=body)
        assert answer.status_code in (400, 404), (path, answer.status_code, answer.text)
        assert field in answer.json()["error"]["message"], (path, answer.text)


def test_paging_goes_on_past_a_cursor_key_that_no_longer_matches_the_filter(admin):
    made = [admin.post("/v1/admin/keys", json={"tenant": "pages"}).json()["api_key"]["id"]
            for _ in range(3)]  # fmt: skip
    active = {"workspace_id": "pages", "status": "active", "limit": 1}
    first = admin.get("/v1/organizations/api_keys", params=active).json()
    assert first["data"][0]["id"] == made[-1] and first["has_more"]  # newest first
    admin.post(f"/v1/organizations/api_keys/{made[-1]}", json={"status": "inactive"})
    rest = admin.get("/v1/organizations/api_keys",
                     params={**active, "limit": 5, "after_id": made[-1]}).json()  # fmt: skip
    assert [k["id"] for k in rest["data"]] == made[-2::-1] and not rest["has_more"]
    before = admin.get("/v1/organizations/api_keys",
                       params={**active, "before_id": made[0]}).json()  # fmt: skip
    assert [k["id"] for k in before["data"]] == [made[1]]
