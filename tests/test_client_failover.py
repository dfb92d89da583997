"""zerohop.client against real replicas on 127.0.0.1: a replica killed mid-stream (SIGKILL)
or drained (SIGTERM) under load, and replicas found by a watched file and by DNS.

Five replicas of the tiny model are started once; each test uses those it needs. The
engines sleep a little after each step, so 32 streams are all mid-answer when one dies.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import anthropic
import pytest

from tests.dns_server import DnsServer
from tests.fixtures.tiny_gguf import write_gguf
from tests.live_server import MODEL_NAME, LiveServer, started_together
from zerohop.client import AsyncClient, ReplicaPool, async_http_client, http_client
from zerohop.client.affinity import rank
from zerohop.client.surfaces import Messages
from zerohop.engine.llm import LLM
from zerohop.engine.sample.sampling_params import SamplingParams

GREEDY = {"temperature": 0}
MAX_TOKENS = 24
STEP_DELAY = "0.04"  # seconds the engines sleep after each step: streams last about a second


@pytest.fixture(scope="module")
def fleet(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    specs = {f"replica{i}": ["--debug-step-delay", STEP_DELAY] for i in range(5)}
    with started_together(llama_dir, specs, tmp_path_factory) as servers:
        yield [servers[f"replica{i}"] for i in range(5)]


@pytest.fixture(scope="module")
def offline(llama_dir: Path) -> LLM:
    return LLM(llama_dir, num_kv_blocks=256)


def expected_text(offline: LLM, question: str) -> tuple[str, int]:
    prompt = offline.tokenizer.encode_chat(user(question))
    output = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    return output.text, len(output.token_ids)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def alive(fleet: list[LiveServer]) -> list[LiveServer]:
    return [server for server in fleet if server.process.poll() is None]


def sdk(pool: ReplicaPool, sync: bool = False) -> anthropic.AsyncAnthropic | anthropic.Anthropic:
    # max_retries=0: any error the transport let through would reach the test.
    kind, http = (anthropic.Anthropic, http_client) if sync else (anthropic.AsyncAnthropic,
                                                                  async_http_client)  # fmt: skip
    return kind(base_url="http://zerohop", api_key="unused", max_retries=0,
                http_client=http(pool=pool))  # fmt: skip


async def stream_answer(
    client: anthropic.AsyncAnthropic, question: str, started: asyncio.Event | None = None
) -> tuple[str, int]:
    """(text, output tokens the final usage reports) of one streamed answer."""
    pieces: list[str] = []
    async with client.messages.stream(
        model=MODEL_NAME, max_tokens=MAX_TOKENS, extra_body=GREEDY, messages=user(question)
    ) as stream:
        async for text in stream.text_stream:
            pieces.append(text)
            if started is not None and len(pieces) >= 3:
                started.set()
        final = await stream.get_final_message()
    return "".join(pieces), final.usage.output_tokens


def prompts_ranking_first(pool: ReplicaPool, url: str, count: int) -> list[str]:
    """Questions whose prefix affinity prefers the replica at `url`."""
    questions = (f"Question {i}: what do you know about the number {i}?" for i in range(10**4))
    chosen = []
    for question in questions:
        if ranks_first(pool, Messages({"messages": user(question)}).affinity_text(), url):
            chosen.append(question)
            if len(chosen) == count:
                return chosen
    raise AssertionError("no prompt ranks this replica first")


def test_sigkill_mid_stream_loses_no_answer(fleet: list[LiveServer], offline: LLM) -> None:
    kill_one_mid_stream([fleet[0], fleet[2], fleet[3]], offline)


@pytest.fixture(scope="module")
def q4_1_file(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(llama_dir, tmp_path_factory.mktemp("failover_q4") / "tiny.gguf", "Q4_1")


@pytest.fixture(scope="module")
def q4_1_fleet(q4_1_file: Path, tmp_path_factory: pytest.TempPathFactory):
    specs = {f"q4-{i}": ["--debug-step-delay", STEP_DELAY] for i in range(3)}
    with started_together(q4_1_file, specs, tmp_path_factory) as servers:
        yield [servers[f"q4-{i}"] for i in range(3)]


def test_sigkill_mid_stream_on_a_q4_1_file_continues_with_the_same_tokens(
    q4_1_fleet: list[LiveServer], q4_1_file: Path
) -> None:
    # The continuation is prefilled on another replica, where the uninterrupted answer's
    # tokens were decoded: equal only if a position computes the same both ways (the
    # quantized products' activations and the attention, row by row).
    kill_one_mid_stream(q4_1_fleet, LLM(q4_1_file, num_kv_blocks=256))


def kill_one_mid_stream(servers: list[LiveServer], offline: LLM) -> None:
    """32 greedy streams over `servers`; SIGKILL the later replica with the most in flight;
    every answer must be the uninterrupted offline answer, each token counted once."""
    victims = {s.url: s for s in servers[1:]}
    pool = ReplicaPool([s.url for s in servers], health_interval=0.5)
    questions = [f"Tell me a story about the number {i}." for i in range(32)]

    async def run() -> tuple[list[tuple[str, int]], str]:
        client = sdk(pool)
        events = [asyncio.Event() for _ in questions]
        tasks = [
            asyncio.create_task(stream_answer(client, q, e))
            for q, e in zip(questions, events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        in_flight = {url: r.in_flight for url, r in pool.replicas.items() if url in victims}
        victim = max(in_flight, key=in_flight.get)
        assert in_flight[victim] >= 3, in_flight
        victims[victim].process.kill()
        answers = await asyncio.gather(*tasks)
        await client.close()
        return answers, victim

    try:
        answers, victim = asyncio.run(run())
        stats = pool.stats()
    finally:
        pool.close()
    for question, (text, output_tokens) in zip(questions, answers, strict=True):
        want_text, want_tokens = expected_text(offline, question)
        assert text == want_text, question
        assert output_tokens == want_tokens, "usage counts each token once"
    assert stats[victim]["resumes"] >= 3
    assert stats[victim]["breaker"] == "open" or stats[victim]["ready"] is False


def test_sigterm_drains_streams_and_new_requests_go_elsewhere(
    fleet: list[LiveServer], offline: LLM
) -> None:
    keeper, leaver = fleet[0], fleet[1]
    pool = ReplicaPool([keeper.url, leaver.url], health_interval=0.2)
    pool.start()  # its replicas known, for prompts_ranking_first
    on_leaver = prompts_ranking_first(pool, leaver.url, 4)  # within the in-flight slack
    later = [f"A later question, number {i}." for i in range(6)]

    async def run() -> tuple[list, list]:
        client = sdk(pool)
        events = [asyncio.Event() for _ in on_leaver]
        tasks = [
            asyncio.create_task(stream_answer(client, q, e))
            for q, e in zip(on_leaver, events, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        leaver.process.terminate()  # SIGTERM: drain
        after = await asyncio.gather(*(stream_answer(client, q) for q in later))
        draining = await asyncio.gather(*tasks)
        await client.close()
        return draining, after

    try:
        requests_before = pool.replicas[leaver.url].stats.requests
        draining, after = asyncio.run(run())
        stats = pool.stats()
    finally:
        pool.close()
    assert leaver.process.wait(timeout=30) == 0
    for question, (text, tokens) in zip(on_leaver + later, draining + after, strict=True):
        assert (text, tokens) == expected_text(offline, question), question
    assert stats[leaver.url]["resumes"] == 0, "its streams finished where they were"
    # New requests went to the keeper: straight away, or after the leaver refused them.
    sent_to_leaver = stats[leaver.url]["requests"] - requests_before - len(on_leaver)
    assert sent_to_leaver == stats[leaver.url]["failures"], stats


def test_grpc_replica_killed_mid_stream(fleet: list[LiveServer], offline: LLM) -> None:
    """SDK streams through `grpc://` replicas, and the own API's gRPC `generate`."""
    survivor, victim = (f"grpc://127.0.0.1:{s.grpc_port}" for s in (fleet[0], fleet[4]))
    pool = ReplicaPool([survivor, victim], health_interval=0.5)
    pool.start()  # its replicas known, for prompts_ranking_first
    questions = prompts_ranking_first(pool, victim, 4)
    texts = [
        t for t in (f"Once upon a time {i}" for i in range(999)) if ranks_first(pool, t, victim)
    ]

    async def generate(client: AsyncClient, prompt: str, started: asyncio.Event) -> list[int]:
        ids: list[int] = []
        fields = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS}
        async for reply in client.generate(**fields, temperature=0, ignore_eos=True):
            ids.extend(reply.token_ids)
            if len(ids) >= 3:
                started.set()
        assert reply.usage.completion_tokens == len(ids)
        return ids

    async def run() -> tuple[list, list]:
        client, own = sdk(pool), AsyncClient(pool=pool)
        events = [asyncio.Event() for _ in range(6)]
        streams = [
            asyncio.create_task(stream_answer(client, q, e))
            for q, e in zip(questions, events[:4], strict=True)
        ]
        generated = [
            asyncio.create_task(generate(own, t, e))
            for t, e in zip(texts[:2], events[4:], strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        fleet[4].process.kill()
        answers = await asyncio.gather(*streams)
        ids = await asyncio.gather(*generated)
        await client.close()
        await own.http.aclose()
        return answers, ids

    try:
        answers, generated = asyncio.run(run())
        stats = pool.stats()
    finally:
        pool.close()
    for question, answer in zip(questions, answers, strict=True):
        assert answer == expected_text(offline, question), question
    for text, ids in zip(texts[:2], generated, strict=True):
        prompt = offline.tokenizer.encode(text)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert ids == offline.generate(prompt, params)[0].token_ids, text
    # Every answer the victim was giving went on elsewhere (one of the six may have gone to
    # the survivor from the start: the victim was 4 in flight ahead, the load bound).
    assert stats[victim]["resumes"] == stats[victim]["requests"] >= 5


def ranks_first(pool: ReplicaPool, prompt: str, url: str) -> bool:
    return rank(pool.affinity.key(prompt), list(pool.replicas.values()))[0].url == url


SAFETY_TIMEOUT = 60.0  # seconds: a net for a broken watcher, not a bound under test


def lands_on(client, pool: ReplicaPool, url: str) -> bool:
    """Send a request every 0.1 s until one lands on `url`; False if none did before the
    safety timeout (the discovery never picked the replica up)."""
    deadline = time.monotonic() + SAFETY_TIMEOUT
    i = 0
    while time.monotonic() < deadline:
        i += 1
        client.messages.create(
            model=MODEL_NAME, max_tokens=1, extra_body=GREEDY, messages=user(f"ping {i}")
        )
        if pool.replicas.get(url) and pool.replicas[url].stats.requests:
            return True
        time.sleep(0.1)
    return False


def left_pool(pool: ReplicaPool, url: str) -> bool:
    """Wait until `url` is no longer in the pool; False after the safety timeout."""
    deadline = time.monotonic() + SAFETY_TIMEOUT
    while url in pool.stats():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_replica_added_to_the_file_gets_traffic(fleet, tmp_path: Path) -> None:
    first, second = alive(fleet)[:2]
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# the fleet\n{first.url}\n")
    pool = ReplicaPool(f"file:{listing}", refresh_interval=0.5)
    try:
        client = sdk(pool, sync=True)
        assert lands_on(client, pool, first.url)
        replace(listing, f"{first.url}\n{second.url}\n")
        assert lands_on(client, pool, second.url)  # the watcher noticed the new line
        replace(listing, f"{second.url}\n")  # the first one leaves: drained from the pool
        assert left_pool(pool, first.url)
        before = pool.stats()
        assert first.url not in before
        for i in range(5):
            client.messages.create(
                model=MODEL_NAME, max_tokens=1, extra_body=GREEDY, messages=user(f"after {i}")
            )
        assert pool.stats()[second.url]["requests"] == before[second.url]["requests"] + 5
    finally:
        pool.close()


def replace(path: Path, text: str) -> None:
    """Rewrite a file in one step, as an operator's tooling should (write, then rename)."""
    staging = path.with_suffix(".new")
    staging.write_text(text)
    os.replace(staging, path)


def test_a_replica_added_to_dns_gets_traffic(fleet) -> None:
    first, second = alive(fleet)[:2]
    srv = "_http._tcp.zerohop.test"
    with DnsServer() as dns:
        dns.set_a("pods.zerohop.test", ["127.0.0.1"])
        dns.set_srv(srv, [(0, 50, first.port, "pods.zerohop.test")])
        pool = ReplicaPool(f"dns+srv://{srv}?nameserver={dns.nameserver}", refresh_interval=0.5)
        try:
            client = sdk(pool, sync=True)
            assert lands_on(client, pool, first.url)
            records = [(0, 50, first.port, "pods.zerohop.test")]
            dns.set_srv(srv, [*records, (0, 50, second.port, "pods.zerohop.test")])
            assert lands_on(client, pool, second.url)  # the next DNS round found it
        finally:
            pool.close()
