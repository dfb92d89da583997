"""The gateway end to end: rate limits, budgets, audit and metrics on live `zerohop serve`
subprocesses, driven by the official SDKs, httpx and grpcio, over a real SQLite key store.

A fast server does most of the work (every limit but concurrency, budgets, gRPC, metrics);
a slow one (`--debug-step-delay`) keeps requests in flight long enough to hold concurrency
slots. The tests that end a server have one of their own: the audit log flushed on SIGTERM,
and the budget across `kill -9` (slow too, so requests are cut in flight). Every key is
created with the `zerohop keys` CLI (run in-process: the same `main`) before its server
starts, each in a tenant of its own, so each test reads counters nobody else touches, in any
order. Timing is only functional: refused now, admitted after the retry-after it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import MODEL_NAME, LiveServer
from zerohop import sse
from zerohop.cli import main as zerohop_main
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

STEP_DELAY = 0.05  # the slow server: 200 tokens take 10 s, far past every wait below
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
IGNORE_EOS = {"ignore_eos": True}  # exact output lengths from the random-weight model
BUDGET = 5000
STREAMS = 64

# name: (tenant, `keys create` flags); each key its own tenant unless shared on purpose.
FAST_KEYS: dict[str, tuple[str, list[str]]] = {
    "rpm3": ("rpm3", ["--rpm", "3"]),
    "retry": ("retry", ["--rpm", "60"]),
    "otpm": ("otpm", ["--otpm", "120"]),
    "itpm": ("itpm", ["--itpm", "3000"]),
    "pair1": ("pair", []),
    "pair2": ("pair", []),
    "grpc": ("grpc", ["--rpm", "1"]),
    "budget": ("budget", ["--budget", str(BUDGET)]),
    "clamp": ("clamp", ["--budget", "300"]),
    "metrics": ("metrics", ["--rpm", "2"]),
    "refused": ("refused", ["--rpm", "1"]),
    "salt1": ("salt1", []),
    "salt2": ("salt2", []),
}
SLOW_KEYS: dict[str, tuple[str, list[str]]] = {"conc": ("conc", ["--max-concurrency", "2"])}
AUDIT_KEYS: dict[str, tuple[str, list[str]]] = {"audit": ("audit", ["--rpm", "2"])}
CRASH_KEYS: dict[str, tuple[str, list[str]]] = {"crash": ("crash", ["--budget", str(BUDGET)])}


# -- helpers ------------------------------------------------------------------------------------


def cli(*args: str) -> str:
    """`zerohop ARGS...` in this process (the CLI's own main); its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = zerohop_main(list(args))
    assert rc == 0, (args, out.getvalue())
    return out.getvalue()


def create_keys(db: Path, specs: dict[str, tuple[str, list[str]]]) -> dict[str, dict]:
    keys = {}
    for name, (tenant, flags) in specs.items():
        keys[name] = json.loads(
            cli("keys", "create", "--tenant", tenant, *flags, "--keys-db", str(db), "--json")
        )
        assert keys[name]["key"].startswith("zh-") and keys[name]["tenant"] == tenant
    return keys


def spend(db: Path, key: dict) -> int:
    """The key's total spend, from `zerohop keys usage --json`."""
    rows = json.loads(cli("keys", "usage", "--keys-db", str(db), "--json"))
    mine = [r for r in rows if r["subject"] == f"key:{key['key_id']}" and r["period"] == "total"]
    assert len(mine) <= 1, rows
    if mine:
        assert mine[0]["budget"] is not None
        assert mine[0]["remaining"] == mine[0]["budget"] - mine[0]["tokens"]
    return mine[0]["tokens"] if mine else 0


def wait_until(check: Callable[[], Any], timeout: float = 3.0, every: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy; its last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def audit_records(directory: Path) -> list[dict]:
    """Every complete record of an audit directory, rotated files first."""
    records = []
    for path in [*sorted(directory.glob("audit-*.jsonl")), directory / "audit.jsonl"]:
        if path.exists():
            data = path.read_bytes()
            complete = data[: data.rfind(b"\n") + 1]
            records += [json.loads(line) for line in complete.splitlines() if line]
    return records


def records_of(directory: Path, key: dict, expected: int, timeout: float = 4.0) -> list[dict]:
    """The key's audit records once at least `expected` are written (the writer flushes every
    0.2 s), plus a short wait so that any extra (a retry nobody should have made) shows too."""
    wait_until(
        lambda: (
            len([r for r in audit_records(directory) if r["key_id"] == key["key_id"]]) >= expected
        ),
        timeout,
    )
    time.sleep(0.4)
    return [r for r in audit_records(directory) if r["key_id"] == key["key_id"]]


def scrape(server: LiveServer) -> dict[tuple[str, frozenset], float]:
    """`GET /metrics`, parsed by prometheus_client: {(sample name, labels): value}."""
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def requests_counted(server: LiveServer, tenant: str) -> dict[str, float]:
    """zerohop_requests_total for `tenant`, as {"surface:status": count}."""
    return {
        f"{dict(labels)['surface']}:{dict(labels)['status']}": value
        for (name, labels), value in scrape(server).items()
        if name == "zerohop_requests_total" and dict(labels).get("tenant") == tenant
    }


def rfc3339(value: str) -> datetime:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value), value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def openai_duration(value: str) -> float:
    """OpenAI's reset durations: "17ms", "1.5s", "6m0s"."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)(ms|s))?", value)
    assert match and value, value
    minutes, number, unit = match.groups()
    seconds = float(number or 0) / (1000 if unit == "ms" else 1)
    return int(minutes or 0) * 60 + seconds


def check_anthropic_headers(
    headers: httpx.Headers, limit: int, kind: str = "requests", debt: float = 0.0
) -> int:
    """The anthropic-ratelimit-{kind}-* triple is there and sane; returns `remaining`."""
    prefix = f"anthropic-ratelimit-{kind}-"
    assert int(headers[prefix + "limit"]) == limit, headers
    remaining = int(headers[prefix + "remaining"])
    assert 0 <= remaining <= limit
    reset = rfc3339(headers[prefix + "reset"])
    now = datetime.now(UTC).timestamp()
    # When the bucket is full again: a minute at most, more for an output bucket in debt.
    assert now - 2 <= reset.timestamp() <= now + 61 + 60 * debt
    assert not any(h.startswith("x-ratelimit-") for h in headers)
    return remaining


def check_openai_headers(
    headers: httpx.Headers, limit: int, kind: str = "requests", debt: float = 0.0
) -> int:
    assert int(headers[f"x-ratelimit-limit-{kind}"]) == limit, headers
    remaining = int(headers[f"x-ratelimit-remaining-{kind}"])
    assert 0 <= remaining <= limit
    # Until the bucket is full again: a minute at most, more for an output bucket in debt.
    assert 0 <= openai_duration(headers[f"x-ratelimit-reset-{kind}"]) <= 60 * (1 + debt)
    assert not any(h.startswith("anthropic-ratelimit-") for h in headers)
    return remaining


def retry_after(headers: httpx.Headers) -> float:
    """The refusal's wait, checked consistent in both forms; seconds."""
    seconds = int(headers["retry-after"])
    millis = int(headers["retry-after-ms"])
    assert seconds >= 1 and 0 < millis <= seconds * 1000 + 1, headers
    return millis / 1000


@dataclass
class Served:
    """A live server, its key store and audit folder, and the keys created for it."""

    server: LiveServer
    keys_db: Path
    audit_dir: Path
    keys: dict[str, dict]

    def secret(self, name: str) -> str:
        return self.keys[name]["key"]

    def post(self, path: str, key: str | None, body: dict, **kw: Any) -> httpx.Response:
        headers = {} if key is None else {"x-api-key": key}
        return httpx.post(self.server.url + path, json=body, headers=headers, timeout=60, **kw)

    def messages(self, key: str | None, max_tokens: int = 4, **body: Any) -> httpx.Response:
        body = {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": CHAT, **body}
        return self.post("/v1/messages", key, body)

    def chat(self, key: str | None, max_tokens: int = 4, **body: Any) -> httpx.Response:
        body = {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": CHAT, **body}
        return self.post("/v1/chat/completions", key, body)

    def anthropic(self, name: str, max_retries: int = 0) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.server.url, api_key=self.secret(name), max_retries=max_retries
        )

    def openai(self, name: str, max_retries: int = 0) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.url + "/v1", api_key=self.secret(name), max_retries=max_retries
        )


def _start(llama_dir: Path, root: Path, specs: dict, extra: list[str]) -> Served:
    db, audit = root / "keys.db", root / "audit"
    keys = create_keys(db, specs)
    args = ["--keys-db", str(db), "--audit-dir", str(audit), *extra]
    server = LiveServer(llama_dir, args).start(root / "server.log")
    return Served(server, db, audit, keys)


@pytest.fixture(scope="module")
def gw(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gateway")
    cli("keys", "tenant", "pair", "--rpm", "2", "--keys-db", str(root / "keys.db"))
    gateway = _start(llama_dir, root, FAST_KEYS, [])
    yield gateway
    gateway.server.stop()


@pytest.fixture(scope="module")
def slow_gw(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("slow_gateway")
    gateway = _start(llama_dir, root, SLOW_KEYS, ["--debug-step-delay", str(STEP_DELAY)])
    yield gateway
    gateway.server.stop()


@pytest.fixture
def audit_gw(llama_dir: Path, tmp_path: Path):
    """A fast server of its own, for the test that stops it with SIGTERM."""
    gateway = _start(llama_dir, tmp_path, AUDIT_KEYS, [])
    yield gateway
    gateway.server.stop()


@pytest.fixture
def crash_gw(llama_dir: Path, tmp_path: Path):
    """A slow server of its own, for the test that ends it with kill -9."""
    root = tmp_path / "crash"
    root.mkdir()
    gateway = _start(llama_dir, root, CRASH_KEYS, ["--debug-step-delay", str(STEP_DELAY)])
    yield gateway
    gateway.server.stop()


# -- rate limits --------------------------------------------------------------------------------


def test_rpm_refuses_the_fourth_request_with_headers_on_every_response(gw: Served) -> None:
    key = gw.secret("rpm3")
    remaining = []
    first = gw.messages(key)
    assert first.status_code == 200, first.text
    remaining.append(check_anthropic_headers(first.headers, 3))
    with httpx.stream(
        "POST",
        gw.server.url + "/v1/messages",
        json={"model": MODEL_NAME, "max_tokens": 4, "messages": CHAT, "stream": True},
        headers={"x-api-key": key},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        remaining.append(check_anthropic_headers(streamed.headers, 3))
        assert "message_stop" in streamed.read().decode()
    third = gw.chat(key)
    assert third.status_code == 200, third.text
    remaining.append(check_openai_headers(third.headers, 3))
    # A bucket of 3 refilled at 3/min: 1 token takes 20 s, so nothing refills in between.
    assert remaining == [2, 1, 0]

    refused = gw.messages(key)
    assert refused.status_code == 429
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "rate limit of 3 requests per minute" in refused.json()["error"]["message"]
    assert refused.json()["request_id"] == refused.headers["request-id"]
    assert 15 <= retry_after(refused.headers) <= 21
    assert check_anthropic_headers(refused.headers, 3) == 0
    assert "x-should-retry" not in refused.headers  # a rate limit is worth retrying

    refused = gw.chat(key)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert 15 <= retry_after(refused.headers) <= 21
    assert check_openai_headers(refused.headers, 3) == 0

    with pytest.raises(anthropic.RateLimitError) as caught:
        gw.anthropic("rpm3").messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
    assert caught.value.status_code == 429 and caught.value.type == "rate_limit_error"
    with pytest.raises(openai.RateLimitError) as caught_openai:
        gw.openai("rpm3").chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
    assert caught_openai.value.status_code == 429


def _drain(gw: Served, key: str) -> None:
    """Spend the key's request bucket until a request is refused, the last response."""

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL_NAME, "max_tokens": 1, "messages": CHAT}
            url = gw.server.url + "/v1/messages"
            responses = await asyncio.gather(
                *(client.post(url, json=body, headers={"x-api-key": key}) for _ in range(60))
            )
        return [r.status_code for r in responses]

    assert set(asyncio.run(burst())) <= {200, 429}
    for _ in range(200):  # refills at 1/s; each admitted request takes another
        if gw.messages(key, max_tokens=1).status_code == 429:
            return
    pytest.fail("the request bucket never ran dry")


def test_sdks_retry_a_rate_limit_after_retry_after_and_succeed(gw: Served) -> None:
    # rpm 60: once dry, the next request is 1 s away; both SDKs wait out retry-after-ms.
    _drain(gw, gw.secret("retry"))
    raw = gw.anthropic("retry", max_retries=2).messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=2, messages=CHAT
    )
    assert raw.retries_taken == 1
    assert raw.parse().usage.output_tokens >= 1
    assert check_anthropic_headers(raw.headers, 60) == 0
    raw = gw.openai("retry", max_retries=2).chat.completions.with_raw_response.create(
        model=MODEL_NAME, max_tokens=2, messages=CHAT
    )
    assert raw.retries_taken == 1
    assert raw.parse().usage.completion_tokens >= 1
    assert check_openai_headers(raw.headers, 60) == 0


def test_otpm_charges_output_as_generated_and_refuses_in_debt(gw: Served) -> None:
    key = gw.secret("otpm")
    # Only an output bucket: OpenAI's "tokens" headers are that bucket (refill 2 tokens/s).
    started = time.monotonic()
    first = gw.chat(key, max_tokens=100, **IGNORE_EOS)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 100
    refill = 2 * (time.monotonic() - started) + 1
    after_first = check_openai_headers(first.headers, 120, "tokens")
    assert 20 <= after_first <= 20 + refill  # 120 - 100, plus what refilled meanwhile
    # Still 20 or so in the bucket: admitted, and the 100 tokens put it 80 in debt.
    second = gw.chat(key, max_tokens=100, **IGNORE_EOS)
    assert second.status_code == 200, second.text
    assert check_openai_headers(second.headers, 120, "tokens", debt=1) == 0
    refused = gw.messages(key)
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "output tokens per minute" in refused.json()["error"]["message"]
    # Paying back ~80 tokens at 2/s: about 40 s, never less than the debt allows.
    assert 25 <= retry_after(refused.headers) <= 41
    assert check_anthropic_headers(refused.headers, 120, "output-tokens", debt=1) == 0
    refused = gw.chat(key)
    assert refused.status_code == 429
    assert check_openai_headers(refused.headers, 120, "tokens", debt=1) == 0


def test_itpm_charges_only_the_uncached_part_of_a_repeated_prompt(gw: Served) -> None:
    key = gw.secret("itpm")
    words = " ".join(f"itpm{i} lorem ipsum" for i in range(50))
    messages = [{"role": "user", "content": words}]
    remaining, usages, times = [3000], [], [time.monotonic()]
    for _ in range(2):
        response = gw.messages(key, max_tokens=1, messages=messages)
        assert response.status_code == 200, response.text
        times.append(time.monotonic())
        usages.append(response.json()["usage"])
        remaining.append(check_anthropic_headers(response.headers, 3000, "input-tokens"))
    first, second = usages
    prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert prompt == second["input_tokens"] + second["cache_read_input_tokens"]
    assert prompt > 500  # long enough for many full cache blocks
    assert second["cache_read_input_tokens"] >= prompt - 32  # all but the last block or so
    for i, usage in enumerate(usages):
        drop = remaining[i] - remaining[i + 1]
        # remaining[i] and remaining[i + 1] were taken at the admissions of requests i - 1
        # and i (the bucket starts full), both within times[i - 1]..times[i + 1]: at
        # 3000/min the bucket refills for at most that long between them.
        refill = 50 * (times[i + 1] - times[max(i - 1, 0)]) + 1
        assert usage["input_tokens"] - refill <= drop <= usage["input_tokens"] + 1, (i, usage)
    assert remaining[1] - remaining[2] < 40  # the cached part was given back


def test_a_tenants_prompt_cache_is_its_own(gw: Served) -> None:
    """The same prompt: cached for its own tenant's next request, never for another tenant's
    (the tenant salts the prefix cache)."""
    prompt = [{"role": "user", "content": "Tell me about the quick brown fox. " * 12}]

    def cached(name: str) -> int:
        reply = gw.openai(name).chat.completions.create(
            model=MODEL_NAME, messages=prompt, max_tokens=2
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("salt1") == 0
    assert cached("salt1") > 0
    assert cached("salt2") == 0


def test_tenant_rpm_applies_across_its_keys(gw: Served) -> None:
    one, two = gw.secret("pair1"), gw.secret("pair2")
    assert gw.messages(one).status_code == 200
    second = gw.chat(two)
    assert second.status_code == 200
    # The keys have no limits of their own: the headers are the tenant's bucket.
    assert check_openai_headers(second.headers, 2) == 0
    for key in (one, two):
        refused = gw.messages(key)
        assert refused.status_code == 429
        assert "tenant:pair: rate limit of 2 requests" in refused.json()["error"]["message"]
        assert 25 <= retry_after(refused.headers) <= 31


def test_grpc_resource_exhausted_with_retry_after_trailers(gw: Served) -> None:
    # ignore_eos: a sampled end of text could end it before its 3 tokens
    request = pb.GenerateRequest(model=MODEL_NAME, prompt="Hello", max_tokens=3, ignore_eos=True)
    metadata = (("x-api-key", gw.secret("grpc")),)
    with grpc.insecure_channel(f"127.0.0.1:{gw.server.grpc_port}") as channel:
        stub = pb_grpc.ZerohopStub(channel)
        replies = list(stub.Generate(request, metadata=metadata, timeout=60))
        assert replies[-1].usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        error = caught.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rate limit of 1 requests per minute" in error.details()
        trailers = dict(error.trailing_metadata())
        assert 55 <= int(trailers["retry-after"]) <= 60
        assert trailers["x-ratelimit-limit-requests"] == "1"
        assert trailers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(grpc.RpcError) as caught:  # and a bad key: UNAUTHENTICATED
            list(stub.Generate(request, metadata=(("x-api-key", "zh-nope"),), timeout=60))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- budgets ------------------------------------------------------------------------------------


async def _budget_stream(client: openai.AsyncOpenAI, max_tokens: int) -> dict:
    """One streamed chat completion: its usage and headers, or the refusal."""
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    except openai.RateLimitError as exc:
        return {"refused": exc}
    usage, finish = None, None
    async for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    return {"headers": raw.headers, "usage": usage, "finish": finish, "retries": raw.retries_taken}


def test_budget_is_never_exceeded_by_64_concurrent_streams(gw: Served) -> None:
    async def run() -> list[dict]:
        client = openai.AsyncOpenAI(
            base_url=gw.server.url + "/v1", api_key=gw.secret("budget"), max_retries=2
        )
        async with client:
            return await asyncio.gather(*(_budget_stream(client, 200) for _ in range(STREAMS)))

    results = asyncio.run(run())
    done = [r for r in results if "usage" in r]
    refused = [r["refused"] for r in results if "refused" in r]
    assert done and refused and len(done) + len(refused) == STREAMS
    used = 0
    for r in done:
        usage = r["usage"]
        assert r["retries"] == 0
        assert r["finish"] == "length"
        clamped = r["headers"].get("x-zerohop-max-tokens-clamped")
        assert usage.completion_tokens == (200 if clamped is None else int(clamped))
        used += usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        used += usage.completion_tokens
    assert used <= BUDGET
    for exc in refused:
        assert exc.status_code == 429
        assert exc.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in exc.response.headers
        assert exc.code == "insufficient_quota"
        assert "token budget exhausted" in exc.message
    # The unused part is given back after the responses: durable soon, awaited by nobody.
    wait_until(lambda: spend(gw.keys_db, gw.keys["budget"]) == used)
    assert spend(gw.keys_db, gw.keys["budget"]) == used
    # One audit record per request: the SDK retried none of the refusals.
    records = records_of(gw.audit_dir, gw.keys["budget"], STREAMS)
    assert len(records) == STREAMS
    assert sorted(r["status"] for r in records) == sorted([200] * len(done) + [429] * len(refused))
    assert {r["decision"] for r in records if r["status"] == 429} == {"budget"}
    audited = sum(r["input_tokens"] + r["output_tokens"] for r in records if r["status"] == 200)
    assert audited == used


def test_clamped_to_what_is_left_then_refused_without_retries(gw: Served) -> None:
    # 300 tokens left, max_tokens 1000: granted 300 - prompt, and the answer stops there.
    raw = gw.openai("clamp", max_retries=2).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=1000, extra_body=IGNORE_EOS
    )
    completion = raw.parse()
    usage = completion.usage
    assert int(raw.headers["x-zerohop-max-tokens-clamped"]) == 300 - usage.prompt_tokens
    assert usage.completion_tokens == 300 - usage.prompt_tokens
    assert completion.choices[0].finish_reason == "length"
    used = 300 - usage.prompt_tokens_details.cached_tokens
    wait_until(lambda: spend(gw.keys_db, gw.keys["clamp"]) == used)
    assert spend(gw.keys_db, gw.keys["clamp"]) == used

    with pytest.raises(openai.RateLimitError) as caught:
        gw.openai("clamp", max_retries=2).chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=10
        )
    assert caught.value.code == "insufficient_quota"
    assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(anthropic.RateLimitError) as caught_anthropic:
        gw.anthropic("clamp", max_retries=2).messages.create(
            model=MODEL_NAME, max_tokens=10, messages=CHAT
        )
    assert caught_anthropic.value.response.headers["x-should-retry"] == "false"
    assert caught_anthropic.value.type == "billing_error"
    # Exactly three requests reached the server: neither SDK retried the refusal.
    records = records_of(gw.audit_dir, gw.keys["clamp"], 3)
    assert [(r["status"], r["decision"]) for r in records] == [
        (200, "clamped"),
        (429, "budget"),
        (429, "budget"),
    ]
    assert records[0]["stop_reason"] == "length"
    assert records[0]["budget_reserved"] == 300
    key = frozenset({("reason", "budget"), ("tenant", "clamp")})
    assert wait_until(lambda: scrape(gw.server).get(("zerohop_refusals_total", key)) == 2)


# -- metrics ------------------------------------------------------------------------------------


def test_metrics_by_surface_status_tenant_refusals_and_vllm_gauges(gw: Served) -> None:
    key = gw.secret("metrics")
    ok_anthropic = gw.messages(key, max_tokens=3)
    ok_openai = gw.chat(key, max_tokens=5, **IGNORE_EOS)
    assert ok_anthropic.status_code == ok_openai.status_code == 200
    assert gw.chat(key).status_code == 429  # rpm 2
    assert gw.chat("zh-not-a-key").status_code == 401
    a, o = ok_anthropic.json()["usage"], ok_openai.json()["usage"]
    uncached = a["input_tokens"] + o["prompt_tokens"] - o["prompt_tokens_details"]["cached_tokens"]
    cached = a["cache_read_input_tokens"] + o["prompt_tokens_details"]["cached_tokens"]
    output = a["output_tokens"] + o["completion_tokens"]

    def labels(**kw: str) -> frozenset:
        return frozenset(kw.items())

    expected = {
        ("zerohop_requests_total", labels(surface="anthropic", status="200", tenant="metrics")): 1,
        ("zerohop_requests_total", labels(surface="openai", status="200", tenant="metrics")): 1,
        ("zerohop_requests_total", labels(surface="openai", status="429", tenant="metrics")): 1,
        ("zerohop_refusals_total", labels(reason="rate_limit_requests", tenant="metrics")): 1,
        ("zerohop_cached_prompt_tokens_total", labels(tenant="metrics")): cached,
        ("zerohop_output_tokens_total", labels(tenant="metrics")): output,
    }

    # The request section may be up to a second stale.
    def settled() -> dict:
        samples = scrape(gw.server)
        return samples if all(samples.get(k) == v for k, v in expected.items()) else {}

    samples = wait_until(settled)
    last = scrape(gw.server)
    assert samples, {k: (last.get(k), v) for k, v in expected.items() if last.get(k) != v}
    assert samples[("zerohop_refusals_total", labels(reason="authentication", tenant="anonymous"))]
    status_401 = labels(surface="openai", status="401", tenant="anonymous")
    assert samples[("zerohop_requests_total", status_401)] >= 1
    prompt_key = ("zerohop_prompt_tokens_total", labels(tenant="metrics"))
    assert samples[prompt_key] >= uncached
    vllm = labels(model_name=MODEL_NAME, engine="0")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert samples[(name, vllm)] == 0
    assert 0 <= samples[("vllm:kv_cache_usage_perc", vllm)] <= 1
    assert samples[("zerohop_kv_cache_blocks", frozenset())] == 256
    assert samples[("zerohop_time_to_first_token_seconds_count", frozenset())] >= 2
    assert samples[("zerohop_e2e_request_latency_seconds_count", frozenset())] >= 3


def test_refused_requests_add_no_prompt_tokens_to_metrics(gw: Served) -> None:
    key = gw.secret("refused")
    ok = gw.messages(key, max_tokens=2)
    assert ok.status_code == 200, ok.text
    assert gw.messages(key).status_code == 429  # rpm 1: refused
    uncached = ok.json()["usage"]["input_tokens"]  # the cached part is not in input_tokens
    tenant = frozenset({("tenant", "refused")})
    prompt_key = ("zerohop_prompt_tokens_total", tenant)

    def recorded(status: str) -> tuple[str, frozenset]:
        return ("zerohop_requests_total", tenant | {("surface", "anthropic"), ("status", status)})

    # Both requests recorded (the refusal last): the scrape is current past the refusal.
    def settled() -> dict:
        samples = scrape(gw.server)
        both = samples.get(recorded("200")) == samples.get(recorded("429")) == 1
        return samples if both and samples.get(prompt_key, 0) >= uncached else {}

    samples = wait_until(settled, timeout=30)
    assert samples, scrape(gw.server)
    assert samples[prompt_key] == uncached


# -- the slow server: requests in flight --------------------------------------------------------


def test_max_concurrency_refuses_a_third_stream_until_one_ends(slow_gw: Served) -> None:
    key = slow_gw.secret("conc")
    url = slow_gw.server.url + "/v1/chat/completions"

    def body(max_tokens: int) -> dict:
        return {"model": MODEL_NAME, "messages": CHAT, "max_tokens": max_tokens, "stream": True}

    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as client:
        long = client.stream("POST", url, json={**body(1000), **IGNORE_EOS}, headers=headers)
        short = client.stream("POST", url, json={**body(20), **IGNORE_EOS}, headers=headers)
        with long as long_response, short as short_response:
            assert long_response.status_code == short_response.status_code == 200
            third = client.post(url, json=body(2), headers=headers)
            assert third.status_code == 429, third.text
            assert "2 requests in flight at most" in third.json()["error"]["message"]
            assert retry_after(third.headers) == pytest.approx(1.0, abs=0.01)
            assert "data: [DONE]" in short_response.read().decode()  # 20 tokens: ~1 s

            # The slot is freed as the stream ends (just after its last byte at most).
            def admitted() -> httpx.Response | None:
                response = client.post(url, json=body(2), headers=headers)
                return None if response.status_code == 429 else response

            third = wait_until(admitted, timeout=30, every=0.05)
            assert third is not None, "not admitted after a stream ended"
            assert third.status_code == 200 and "data: [DONE]" in third.text
            # The long stream still holds its slot; one more fits.
            assert client.post(url, json=body(1), headers=headers).status_code == 200
        # The long stream's client went away: its slot is freed (the engine aborts it).
        assert wait_until(
            lambda: all(
                client.post(url, json=body(1), headers=headers).status_code == 200 for _ in range(2)
            )
        )


async def _crash_stream(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> dict:
    """One raw SSE stream, recording how far it got: refused, completed, or cut."""
    body = {
        "model": MODEL_NAME,
        "messages": CHAT,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **IGNORE_EOS,
    }
    state: dict[str, Any] = {"max_tokens": max_tokens}
    try:
        async with client.stream("POST", url, json=body, headers={"x-api-key": key}) as response:
            state["status"] = response.status_code
            state["headers"] = response.headers
            if response.status_code != 200:
                state["body"] = json.loads(await response.aread())
                return state
            async for event in sse.aevents(response.aiter_bytes()):
                if event.data is None:
                    continue
                if event.data == b"[DONE]":
                    state["done"] = True
                    break
                chunk = json.loads(event.data)
                if chunk.get("usage"):
                    state["usage"] = chunk["usage"]
    except httpx.HTTPError as exc:
        state["error"] = repr(exc)
    return state


def test_budget_holds_across_kill_9_and_restart(
    crash_gw: Served, llama_dir: Path, tmp_path: Path
) -> None:
    key = crash_gw.keys["crash"]
    url = crash_gw.server.url + "/v1/chat/completions"

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=STREAMS + 4)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            # A quarter ask for 8 tokens (done in well under a second); the rest for 200
            # (10 s at 0.05 s a step): the kill lands with some done and most in flight.
            tasks = [
                asyncio.create_task(
                    _crash_stream(client, url, key["key"], 8 if i % 4 == 0 else 200)
                )
                for i in range(STREAMS)
            ]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                finished = [t for t in tasks if t.done() and t.result().get("done")]
                if len(finished) >= 3:
                    break
                await asyncio.sleep(0.05)
            crash_gw.server.process.kill()  # kill -9
            crash_gw.server.process.wait()
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    completed = [r for r in results if r.get("done")]
    refused = [r for r in results if r.get("status") == 429]
    cut = [r for r in results if r.get("status") == 200 and not r.get("done")]
    assert len(completed) >= 3 and refused and cut, results
    assert len(completed) + len(refused) + len(cut) == STREAMS
    for r in refused:
        assert r["headers"]["x-should-retry"] == "false"
        assert r["body"]["error"]["code"] == r["body"]["error"]["type"] == "insufficient_quota"
    prompt = completed[0]["usage"]["prompt_tokens"]
    used = 0
    for r in completed:
        usage = r["usage"]
        assert usage["completion_tokens"] == _granted(r)
        used += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        used += usage["completion_tokens"]
    # A cut stream got its headers after its first step: its reservation was durable by then.
    in_flight = sum(prompt + _granted(r) for r in cut)

    # The same key store and audit log, at full speed.
    args = ["--keys-db", str(crash_gw.keys_db), "--audit-dir", str(crash_gw.audit_dir)]
    restarted = LiveServer(llama_dir, args).start(tmp_path / "restarted.log")
    try:
        spent = spend(crash_gw.keys_db, key)
        assert used + in_flight <= spent <= BUDGET
        left = BUDGET - spent
        response = httpx.post(
            restarted.url + "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1000, **IGNORE_EOS},
            headers={"x-api-key": key["key"]},
            timeout=120,
        )
        if left >= prompt + 1:  # what is left is granted, no more
            assert response.status_code == 200, response.text
            granted = left - prompt
            assert int(response.headers["x-zerohop-max-tokens-clamped"]) == granted
            usage = response.json()["usage"]
            assert usage["completion_tokens"] == granted
            assert response.json()["choices"][0]["finish_reason"] == "length"
            # Everything is spent now, but for the cached prompt tokens given back.
            expected = BUDGET - usage["prompt_tokens_details"]["cached_tokens"]
            wait_until(lambda: spend(crash_gw.keys_db, key) == expected)
            assert spend(crash_gw.keys_db, key) == expected
        else:
            assert response.status_code == 429, response.text
            assert response.headers["x-should-retry"] == "false"
            assert response.json()["error"]["code"] == "insufficient_quota"
            assert spend(crash_gw.keys_db, key) == spent
        again = httpx.post(
            restarted.url + "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 5},
            headers={"x-api-key": key["key"]},
            timeout=60,
        )
        assert again.status_code == 429 and again.headers["x-should-retry"] == "false"
    finally:
        code = restarted.stop()
    assert code == 0
    # The audit chain survives the crash (a torn last line is set aside) and the restart.
    cli("audit", "verify", str(crash_gw.audit_dir))


def _granted(stream: dict) -> int:
    clamped = stream["headers"].get("x-zerohop-max-tokens-clamped")
    return stream["max_tokens"] if clamped is None else int(clamped)


# -- audit (a server of its own: the test stops it) ---------------------------------------------


def test_audit_one_record_per_request_flushed_on_sigterm(audit_gw: Served) -> None:
    gw = audit_gw
    key = gw.secret("audit")
    sent: dict[str, tuple[int, str]] = {}  # request id -> (status, expected key_id)

    def note(response: httpx.Response, key_id: str) -> None:
        sent[response.headers["request-id"]] = (response.status_code, key_id)

    key_id = gw.keys["audit"]["key_id"]
    note(gw.messages("zh-wrong"), "anonymous")
    note(gw.chat(None), "anonymous")
    note(gw.messages(key, max_tokens=3), key_id)
    note(gw.chat(key, max_tokens=4, **IGNORE_EOS), key_id)
    note(gw.chat(key), key_id)  # rpm 2: refused, the last request
    assert sorted(s for s, _ in sent.values()) == [200, 200, 401, 401, 429]
    # The request metrics are re-rendered at most once a second: wait for a scrape that has
    # the last request in it, hence every one before.
    refused = ("zerohop_requests_total", frozenset(
        {("surface", "openai"), ("status", "429"), ("tenant", "audit")}
    ))  # fmt: skip

    def current() -> dict:
        samples = scrape(gw.server)
        return samples if samples.get(refused) else {}

    samples = wait_until(current, timeout=30)
    assert samples, scrape(gw.server)
    served = sum(v for (name, _), v in samples.items() if name == "zerohop_requests_total")
    assert gw.server.stop() == 0  # SIGTERM: everything queued is written and fsynced

    records = audit_records(gw.audit_dir)
    by_id = {}
    for record in records:
        assert record["request_id"] not in by_id, record
        by_id[record["request_id"]] = record
    assert [r["seq"] for r in records] == list(range(len(records)))
    for request_id, (status, expected_key) in sent.items():
        record = by_id[request_id]
        assert record["status"] == status and record["key_id"] == expected_key, record
        assert record["tenant"] == ("audit" if expected_key == key_id else "anonymous")
        for name in ("time", "surface", "decision", "input_tokens", "output_tokens"):
            assert name in record, (name, record)
        assert "prompt" not in record and "output" not in record  # no --audit-content
    ok = [by_id[i] for i, (s, _) in sent.items() if s == 200]
    assert [r["decision"] for r in ok] == ["admitted", "admitted"]
    assert ok[1]["output_tokens"] == 4 and all(r["input_tokens"] > 0 for r in ok)
    assert [by_id[i]["decision"] for i, (s, _) in sent.items() if s == 429] == [
        "rate_limit_requests"
    ]
    assert {by_id[i]["decision"] for i, (s, _) in sent.items() if s == 401} == {"authentication"}
    # Every request this server answered is in the log, and no secret ever is.
    assert len(records) == served
    text = b"".join(p.read_bytes() for p in gw.audit_dir.iterdir() if p.is_file())
    for entry in gw.keys.values():
        assert entry["key"].encode() not in text
        assert entry["key"][3:].encode() not in text
    assert b"zh-wrong" not in text
    assert "ok:" in cli("audit", "verify", str(gw.audit_dir))
