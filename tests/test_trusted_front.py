"""zerohop behind a trusted front such as Anthropic's `claude gateway` (issue 51): the end user
its forward_user_identity headers name lands in the audit log (and its search) only from a
--trusted-front address; Messages answers carry the unified rate-limit headers Claude Code
reads; a spent budget is a 429 billing_error it stops on. Claude Code itself goes through an
in-test front that adds x-claude-gateway-user-id, as `claude gateway` does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from multidict import CIMultiDict

from tests.claude_code import ClaudeCode, require_claude_code
from tests.fixtures.long_context_model import build_long_context_model
from tests.live_server import MODEL_NAME, started_together
from tests.recording_proxy import RecordingProxy
from tests.test_claude_code import SERVER_ARGS
from tests.test_gateway_limits import CHAT, audit_records, create_keys, wait_until
from zerohop.models.default import default_model_path

KEYS: dict[str, tuple[str, list[str]]] = {
    "dev": ("fleet", ["--rpm", "10", "--budget", "100000/day"]),
    "spent": ("spent", ["--budget", "1/day"]),
    "admin": ("ops", ["--admin"]),
}
IDENTITY = {
    "x-claude-gateway-user-id": "sub-7f3a",
    "x-claude-gateway-user-email": "ada%40example.com",  # claude gateway percent-encodes
    "x-litellm-end-user-id": "ada@example.com",
}


class IdentityFront(RecordingProxy):
    """A `claude gateway` stand-in: forwards everything, adding the identity headers."""

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = CIMultiDict(request.headers)
        headers.update(IDENTITY)
        return await super()._forward(request.clone(headers=headers))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two servers on one key store: one trusts 127.0.0.0/8, the other an address no test
    client has. The model is Claude Code's test model (a context its prompt fits in)."""
    root = tmp_path_factory.mktemp("trusted_front")
    model = build_long_context_model(root / "model", default_model_path())
    keys = create_keys(root / "keys.db", KEYS)
    base = [*SERVER_ARGS, "--keys-db", str(root / "keys.db")]
    specs = {
        "trusted": [*base, "--audit-dir", str(root / "a1"), "--trusted-front", "127.0.0.0/8"],
        "other": [*base, "--audit-dir", str(root / "a2"), "--trusted-front", "10.9.9.9"],
    }
    with started_together(model, specs, tmp_path_factory) as started:
        yield {"keys": keys, "root": root, **started}


def _messages(url: str, key: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": CHAT}
    sent = {"x-api-key": key["key"], **(headers or {})}
    return httpx.post(url + "/v1/messages", json=body, headers=sent, timeout=60)


def _audit(server, admin: dict, **query: str) -> list[dict]:
    answer = httpx.get(
        server.url + "/v1/admin/audit", params={"kind": "request", **query},
        headers={"x-api-key": admin["key"]}, timeout=30,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def _next_utc_midnight() -> int:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return int((today + timedelta(days=1)).timestamp())


def test_end_user_from_the_trusted_front_only_and_unified_headers(servers: dict) -> None:
    keys, trusted, other = servers["keys"], servers["trusted"], servers["other"]
    answer = _messages(trusted.url, keys["dev"], IDENTITY)
    assert answer.status_code == 200, answer.text
    h = answer.headers
    # rpm 10, one request made: 10% of the short window, the rest of the budget far below.
    assert float(h["anthropic-ratelimit-unified-5h-utilization"]) == pytest.approx(0.1)
    assert h["anthropic-ratelimit-unified-5h-status"] == "allowed"
    assert "anthropic-ratelimit-unified-5h-surpassed-threshold" not in h
    assert 0 < float(h["anthropic-ratelimit-unified-7d-utilization"]) < 0.01
    assert int(h["anthropic-ratelimit-unified-7d-reset"]) == _next_utc_midnight()
    assert h["anthropic-ratelimit-unified-status"] == "allowed"
    assert h["anthropic-ratelimit-unified-representative-claim"] == "five_hour"
    five_hour_reset = int(h["anthropic-ratelimit-unified-reset"])
    assert time.time() - 1 <= five_hour_reset <= time.time() + 61  # the minute's bucket
    assert int(h["anthropic-ratelimit-requests-remaining"]) == 9
    # The same headers to a server that trusts another address: no one is named.
    assert _messages(other.url, keys["dev"], IDENTITY).status_code == 200
    # OpenAI's surface keeps its own headers only.
    chat = httpx.post(
        trusted.url + "/v1/chat/completions", timeout=60,
        json={"model": MODEL_NAME, "max_tokens": 2, "messages": CHAT},
        headers={"authorization": f"Bearer {keys['dev']['key']}"},
    )  # fmt: skip
    assert chat.status_code == 200 and "anthropic-ratelimit-unified-status" not in chat.headers

    admin = keys["admin"]
    mine = wait_until(lambda: _audit(trusted, admin, end_user="ada@example.com"), 5)
    assert [(r["end_user"], r["end_user_email"], r["status"]) for r in mine] == [
        ("sub-7f3a", "ada@example.com", 200)
    ]
    assert [r["request_id"] for r in _audit(trusted, admin, end_user="sub-7f3a")] == [
        mine[0]["request_id"]
    ]
    records = wait_until(lambda: audit_records(servers["root"] / "a2"), 5)
    assert len(records) == 1 and records[0]["status"] == 200, records
    assert "end_user" not in records[0] and "end_user_email" not in records[0]


def test_a_spent_budget_is_a_billing_error_not_to_retry(servers: dict) -> None:
    keys, trusted = servers["keys"], servers["trusted"]
    refused = _messages(trusted.url, keys["spent"])
    assert refused.status_code == 429
    body = refused.json()
    assert body["type"] == "error" and body["error"]["type"] == "billing_error"
    assert "token budget exhausted" in body["error"]["message"]
    assert refused.headers["x-should-retry"] == "false"
    # Retry when the day's budget starts over (next UTC midnight), not before.
    wait = int(refused.headers["retry-after"])
    assert abs(time.time() + wait - _next_utc_midnight()) <= 2
    # OpenAI's surface keeps its documented insufficient_quota.
    chat = httpx.post(
        trusted.url + "/v1/chat/completions", timeout=60,
        json={"model": MODEL_NAME, "max_tokens": 2, "messages": CHAT},
        headers={"authorization": f"Bearer {keys['spent']['key']}"},
    )  # fmt: skip
    assert chat.status_code == 429 and chat.json()["error"]["type"] == "insufficient_quota"


def test_claude_code_behind_the_front_is_audited_as_its_user(servers: dict, tmp_path: Path) -> None:
    """Claude Code through the front, on a key whose budget is spent: each request it makes
    is refused at admission (no model run), audited under the user the front named, and
    Claude Code reports the billing error and stops."""
    require_claude_code()
    keys, trusted = servers["keys"], servers["trusted"]
    claude = ClaudeCode(tmp_path / "home", tmp_path / "project", api_key=keys["spent"]["key"])
    front = IdentityFront(trusted.url).start()
    try:
        run = claude.run(front.url, "Say hello.", "--model", MODEL_NAME, timeout=120)
    finally:
        front.stop()
    assert run.result["is_error"], run
    assert "budget" in str(run.result.get("result", "")) + run.stderr, run
    messages = [e for e in front.exchanges if e.path.startswith("/v1/messages")]
    assert messages and all(e.status == 429 for e in messages), messages
    assert all(e.request_headers["x-claude-gateway-user-id"] == "sub-7f3a" for e in messages)

    def claude_codes_records() -> list[dict]:
        # The key's other tests' records may be written first: the audit log is written in
        # the background, so wait for this user's own.
        audited = _audit(trusted, keys["admin"], api_key_id=keys["spent"]["key_id"])
        return [r for r in audited if r.get("end_user") == "sub-7f3a"]

    claude_code = wait_until(claude_codes_records, 5)
    assert claude_code and all(r["status"] == 429 for r in claude_code), claude_code
    assert {r["end_user_email"] for r in claude_code} == {"ada@example.com"}
