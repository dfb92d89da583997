"""zerohop's gateway on vLLM's engine (its CPU build here), end to end on one live server:
budgets and per-key limits charged per token under 16 concurrent streams, the GIE / llm-d
gauges from vLLM's steps, fair share inside vLLM's scheduler (a light tenant is served ahead
of a flooding tenant's queue), a batch run on the capacity interactive work leaves, and the
EngineCore killed mid-stream: the stream ends with the API's error, /health holds, /ready
tells the truth, and a new EngineCore serves again. One vLLM start for the module (the kill
test last). Timing is only functional: which request started before which."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.engines import serve_on
from tests.live_server import MODEL_NAME, LiveServer, free_port
from tests.test_gateway_limits import (
    CHAT,
    IGNORE_EOS,
    _budget_stream,
    create_keys,
    scrape,
    spend,
    wait_until,
)
from zerohop.models.tiny import tiny_model_dir

BUDGET = 1500
STREAMS = 16
MAX_SEQS = 4  # a queue forms behind four running streams
KV_EVENTS = f"tcp://127.0.0.1:{free_port()}"  # vLLM's KV cache events, for llm-d's router
KEYS = {
    "budget": ("budget", ["--budget", str(BUDGET)]),
    "otpm": ("otpm", ["--otpm", "300"]),
    "flood": ("flood", []),
    "light": ("light", []),
    "open": ("open", []),
    "salt1": ("salt1", []),
    "salt2": ("salt2", []),
}


class Served:
    def __init__(self, server: LiveServer, keys_db: Path, keys: dict[str, dict]) -> None:
        self.server, self.keys_db, self.keys = server, keys_db, keys

    def client(self, name: str, max_retries: int = 0) -> openai.AsyncOpenAI:
        key = self.keys[name]["key"]
        return openai.AsyncOpenAI(
            base_url=self.server.url + "/v1", api_key=key, max_retries=max_retries
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("vllm-gateway")
    db = root / "keys.db"
    keys = create_keys(db, KEYS)
    args = ["--keys-db", str(db), "--audit-dir", str(root / "audit")]
    args += ["--max-num-seqs", str(MAX_SEQS), "--engine-max-restarts", "2"]
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    args += ["--kv-events-config", json.dumps(events | {"endpoint": KV_EVENTS}), "--vllm-arg"]
    args += ["seed=7"]  # any other field of vLLM's engine arguments passes through
    server = serve_on("vllm", tiny_model_dir(), root / "server.log", args)
    yield Served(server, db, keys)
    server.stop()


def test_budget_is_never_exceeded_by_16_concurrent_streams(served: Served) -> None:
    async def run() -> list[dict]:
        async with served.client("budget", max_retries=2) as client:
            return await asyncio.gather(*(_budget_stream(client, 200) for _ in range(STREAMS)))

    results = asyncio.run(run())
    done = [r for r in results if "usage" in r]
    refused = [r for r in results if "refused" in r]
    assert done and refused and len(done) + len(refused) == STREAMS
    used = 0
    for r in done:
        clamped = r["headers"].get("x-zerohop-max-tokens-clamped")
        assert r["usage"].completion_tokens == (200 if clamped is None else int(clamped))
        used += r["usage"].prompt_tokens - r["usage"].prompt_tokens_details.cached_tokens
        used += r["usage"].completion_tokens
    assert used <= BUDGET
    wait_until(lambda: spend(served.keys_db, served.keys["budget"]) == used)
    assert spend(served.keys_db, served.keys["budget"]) == used


def test_output_tokens_are_charged_as_generated(served: Served) -> None:
    """--otpm 300: 16 streams of 40 tokens run (the bucket goes into debt by what they
    produce, as on zerohop's engine), and the next request is refused until it refills."""

    async def run() -> list[dict]:
        async with served.client("otpm") as client:
            return await asyncio.gather(*(_budget_stream(client, 40) for _ in range(STREAMS)))

    results = asyncio.run(run())
    produced = sum(r["usage"].completion_tokens for r in results if "usage" in r)
    assert produced > 300
    after = httpx.post(
        served.server.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {served.keys['otpm']['key']}"},
        json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4},
    )
    assert after.status_code == 429 and int(after.headers["retry-after"]) >= 1


def test_a_tenants_prompt_cache_is_its_own(served: Served) -> None:
    """vLLM's prefix cache, salted by the tenant: a repeated prompt hits for its own tenant
    (usage's cached tokens), never for another's."""
    prompt = "a prompt long enough to fill a block of one hundred and twenty-eight tokens " * 8

    def cached(name: str) -> int:
        reply = httpx.post(
            served.server.url + "/v1/completions",
            headers={"authorization": f"Bearer {served.keys[name]['key']}"},
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2},
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("salt1") == 0
    assert cached("salt1") >= 128  # vLLM's CPU build caches whole blocks of 128 tokens
    assert cached("salt2") == 0


def test_gie_gauges_come_from_vllms_steps(served: Served) -> None:
    samples = scrape(served.server)
    names = {name for name, _ in samples}
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert gauge in names
    usage = [v for (name, _), v in samples.items() if name == "vllm:kv_cache_usage_perc"]
    assert usage and 0.0 <= usage[0] <= 1.0
    info = [labels for (name, labels), _ in samples.items() if name == "vllm:cache_config_info"]
    assert info and ("block_size", "128") in info[0]


def test_vllms_kv_events_publisher_runs(served: Served) -> None:
    """--kv-events-config passes through to vLLM, whose EngineCore starts its ZeroMQ publisher
    of KV cache events (what llm-d's KV-aware router subscribes to). vLLM's CPU build publishes
    no BlockStored events even on its own (vllm.LLM with the same config, checked by hand), so
    the events themselves are left to a GPU run (scripts/gpu_check.sh)."""
    assert "Starting ZMQ publisher thread" in served.server.log()


def test_a_light_tenant_is_served_ahead_of_a_flooding_tenants_queue(served: Served) -> None:
    """Three times MAX_SEQS streams of the flooding tenant, then one of a light tenant: under
    first come first served it would start after the whole flood; under fair share it starts
    in the next free slot, ahead of the flood's queue."""
    firsts: dict[str, float] = {}

    async def stream(client: openai.AsyncOpenAI, name: str, max_tokens: int) -> None:
        events = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=CHAT,
            max_tokens=max_tokens,
            stream=True,
            extra_body=IGNORE_EOS,
        )
        async for chunk in events:  # the first chunk (the role) comes at admission
            if any(c.delta.content for c in chunk.choices):
                firsts.setdefault(name, time.monotonic())

    async def run() -> None:
        async with served.client("flood") as flood, served.client("light") as light:
            flooding = [
                asyncio.create_task(stream(flood, f"flood{i}", 48)) for i in range(3 * MAX_SEQS)
            ]
            await wait_for(lambda: len(firsts) >= MAX_SEQS)  # the flood holds every slot
            await stream(light, "light", 4)
            await asyncio.gather(*flooding)

    asyncio.run(run())
    later = [name for name, at in firsts.items() if at > firsts["light"]]
    assert len(later) >= MAX_SEQS, firsts


async def wait_for(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_a_batch_runs_on_the_vllm_engine(served: Served, tmp_path: Path) -> None:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 6},
        }
        for i in range(3)
    ]
    key = {"authorization": f"Bearer {served.keys['open']['key']}"}
    base = served.server.url + "/v1"
    upload = httpx.post(
        base + "/files",
        headers=key,
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", "\n".join(json.dumps(line) for line in lines))},
    )
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions"}
    batch = httpx.post(base + "/batches", headers=key, json=body | {"completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    url = f"{base}/batches/{batch.json()['id']}"
    done = wait_until(
        lambda: httpx.get(url, headers=key).json()["status"] == "completed", timeout=60
    )
    assert done
    result = httpx.get(url, headers=key).json()
    assert result["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    output = httpx.get(f"{base}/files/{result['output_file_id']}/content", headers=key).text
    rows = [json.loads(line) for line in output.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"line-{i}" for i in range(3)]
    assert all(r["response"]["status_code"] == 200 for r in rows)


def engine_core_pid(server: LiveServer) -> int:
    """vLLM's EngineCore: the API process's child that has children (its worker)."""
    assert server.process is not None
    tasks = Path(f"/proc/{server.process.pid}/task").glob("*/children")
    children = [int(child) for task in tasks for child in task.read_text().split()]
    for pid in children:
        grandchildren = Path(f"/proc/{pid}/task").glob("*/children")
        if any(task.read_text().split() for task in grandchildren):
            return pid
    raise AssertionError(f"no EngineCore among {children}")


def test_engine_core_killed_mid_stream_restarts(served: Served) -> None:
    """Last: the stream in flight ends with OpenAI's 503-style error (no hang), /health
    stays 200 while /ready is 503, and a new EngineCore serves again."""
    url = served.server.url
    key = {"authorization": f"Bearer {served.keys['open']['key']}"}
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1500, "stream": True}
    body |= IGNORE_EOS
    killed = None
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=key) as r:
        for line in r.iter_lines():
            if killed is None and line.startswith("data:"):
                killed = engine_core_pid(served.server)
                os.kill(killed, signal.SIGKILL)
            lines.append(line)
    assert killed is not None
    errors = [line for line in lines if '"error"' in line]
    assert errors and "restarting" in errors[-1], lines[-3:]
    assert httpx.get(url + "/health").status_code == 200
    assert wait_until(lambda: httpx.get(url + "/ready").status_code == 200, timeout=240)
    again = httpx.post(
        url + "/v1/chat/completions",
        headers=key,
        json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4},
    )
    assert again.status_code == 200, again.text
    assert engine_core_pid(served.server) != killed
    restarts = [v for (name, _), v in scrape(served.server).items() if "restarts" in name]
    assert restarts and max(restarts) >= 1
