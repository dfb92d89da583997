"""Send-time stamps in streams and `zerohop probe`, against a live server over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx2
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.bench.probe import ProbeConfig, ProbeRun, RequestProbe, run_probe

STAMP = ": zerohop-sent "
T = TypeVar("T")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QUESTION = "Tell me about the quick brown fox."
STREAMS = {
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": QUESTION}]}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]}),
    "completions": ("/v1/completions", {"prompt": QUESTION}),
}


def stream_lines(server: LiveServer, surface: str, headers: dict[str, str]) -> list[str]:
    path, body = STREAMS[surface]
    body = {**body, "model": MODEL_NAME, "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx2.stream("POST", server.url + path, json=body, headers=headers) as response:
        assert response.status_code == 200
        return list(response.iter_lines())


@pytest.mark.parametrize("surface", list(STREAMS))
def test_send_times_only_when_asked(live_server: LiveServer, surface: str) -> None:
    assert not any(line.startswith(":") for line in stream_lines(live_server, surface, {}))
    before = time.time()
    lines = stream_lines(live_server, surface, {"zerohop-send-times": "1"})
    stamps = [float(line.removeprefix(STAMP)) for line in lines if line.startswith(STAMP)]
    events = [line for line in lines if line.startswith("data: ")]
    # One stamp per write, each in front of whole events; the opening and closing events
    # share their writes with tokens.
    assert len(events) > len(stamps) >= 2
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= time.time()
    for i, line in enumerate(lines):
        if line.startswith(STAMP):
            assert lines[i + 1].startswith(("event: ", "data: "))


def test_sdks_read_stamped_streams(live_server: LiveServer) -> None:
    sent_headers: list[str | None] = []

    def stamped_client() -> httpx2.Client:
        def remember(request: httpx2.Request) -> None:
            sent_headers.append(request.headers.get("zerohop-send-times"))

        return httpx2.Client(
            headers={"zerohop-send-times": "1"}, event_hooks={"request": [remember]}
        )

    def claude(http_client: httpx2.Client | None) -> str:
        sdk = anthropic.Anthropic(
            base_url=live_server.url, api_key="k", max_retries=0, http_client=http_client
        )
        messages = [{"role": "user", "content": QUESTION}]
        events = sdk.messages.create(
            model=MODEL_NAME,
            max_tokens=8,
            messages=messages,
            stream=True,
            extra_body={"temperature": 0},
        )
        return "".join(e.delta.text for e in events if e.type == "content_block_delta")

    def gpt(http_client: httpx2.Client | None) -> str:
        sdk = openai.OpenAI(
            base_url=live_server.url + "/v1", api_key="k", max_retries=0, http_client=http_client
        )
        messages = [{"role": "user", "content": QUESTION}]
        chunks = sdk.chat.completions.create(
            model=MODEL_NAME, max_tokens=8, messages=messages, stream=True, temperature=0
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    for read in (claude, gpt):
        with stamped_client() as http_client:
            assert read(http_client) == read(None) != ""
    assert sent_headers == ["1", "1"]


def direct_run(config: ProbeConfig, tries: int = 3) -> ProbeRun:
    """A probe run straight to the server. On a busy 2-core machine the probing client can be
    descheduled long enough to read a few tokens in one burst, which looks like buffering;
    a real buffer would show on every run, so one of `tries` runs must show none."""
    for _ in range(tries):
        run = run_probe(config)
        if not any(probe.buffering.detected for probe in run.requests):
            break
    return run


def check_direct(probe: RequestProbe) -> None:
    tokens = len(probe.token_received_s)
    assert probe.status == 200 and probe.error is None
    assert 0 < probe.ttfb_s <= probe.ttft_s <= probe.total_s
    assert tokens == probe.output_tokens and len(probe.gaps_s) == tokens - 1
    assert probe.stamped_events >= tokens - 1
    assert len(probe.added_delay_s) == tokens and min(probe.added_delay_s) >= 0
    assert probe.buffering.stamps and probe.buffering.detected is False


def test_probe_direct_connection_reused(live_server: LiveServer) -> None:
    config = ProbeConfig(live_server.url, model=MODEL_NAME, max_tokens=16, repeat=2)
    first, second = direct_run(config).requests
    for probe in (first, second):
        check_direct(probe)
        assert probe.http_version == "HTTP/1.1" and probe.tls_s is None
        assert probe.remote_address == f"127.0.0.1:{live_server.port}"
    assert not first.reused_connection and first.dns_s is not None and first.connect_s > 0
    assert second.reused_connection and second.dns_s is None and second.connect_s is None
    assert first.proxy_headers == {"server": "zerohop"}


@pytest.mark.parametrize("endpoint", ["anthropic-messages", "openai-completions"])
def test_probe_other_endpoints_over_h2c(live_server: LiveServer, endpoint: str) -> None:
    config = ProbeConfig(live_server.url, endpoint=endpoint, max_tokens=8, http2=True)
    run = direct_run(config)
    assert run.model == MODEL_NAME  # the first of GET /v1/models
    check_direct(run.requests[0])
    assert run.requests[0].http_version == "HTTP/2"


def test_probe_cli_json_and_plot(live_server: LiveServer, tmp_path: Path) -> None:
    plot = tmp_path / "timeline.png"
    command = [sys.executable, "-m", "zerohop", "probe", live_server.url, "--json"]
    command += ["--max-tokens", "8", "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["endpoint"] == "openai-chat" and record["model"] == MODEL_NAME
    probe = record["requests"][0]
    assert probe["http_version"] == "HTTP/1.1" and probe["ttfb_s"] <= probe["ttft_s"]
    assert len(probe["gaps_s"]) == len(probe["token_received_s"]) - 1
    assert probe["buffering"]["stamps"] and probe["buffering"]["detected"] is False
    assert plot.read_bytes().startswith(PNG_SIGNATURE)


class BufferingProxy:
    """A TCP proxy that passes requests straight on but holds each response, forwarding what
    it has gathered every `hold_s` seconds, as a proxy with response buffering on does. It
    marks the first response of a connection with `headers` (a `via` header)."""

    headers = b"via: 1.1 buffering-proxy\r\n"

    def __init__(self, upstream_port: int, hold_s: float = 0.2) -> None:
        self.upstream_port, self.hold_s = upstream_port, hold_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> BufferingProxy:
        self.thread.start()
        self.server = self._call(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _shut(self) -> None:
        self.server.close()
        connections = asyncio.all_tasks() - {asyncio.current_task()}
        for task in connections:
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(5)

    async def _connection(
        self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter
    ) -> None:
        upstream, to_upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        # Ended by the proxy's shutdown: swallowed, as asyncio's stream callback would log it.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pass(client, to_upstream), self._hold(upstream, to_client))

    async def _pass(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
        sink.close()

    async def _hold(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        held = bytearray()
        reading = asyncio.ensure_future(self._gather(source, held))
        while not reading.done() or held:
            await asyncio.sleep(self.hold_s)
            if held:
                sink.write(bytes(held))
                held.clear()
                await sink.drain()
        sink.close()

    async def _gather(self, source: asyncio.StreamReader, held: bytearray) -> None:
        status_line = await source.readline()  # of the first response: mark it as proxied
        held += status_line + self.headers
        while data := await source.read(65536):
            held += data


@pytest.fixture(scope="module")
def paced_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny model at ~5 ms a token: unpaced, it can send all 64 tokens within a few ms
    (its prompt cached by the direct run), and a stream sent that fast arrives as one burst
    with or without a buffer in between, so nothing could tell the proxy is there."""
    log = tmp_path_factory.mktemp("paced") / "server.log"
    server = LiveServer(llama_dir, ["--debug-step-delay", "0.005"]).start(log)
    yield server
    server.stop()


@pytest.fixture
def buffering_proxy(paced_server: LiveServer) -> Iterator[BufferingProxy]:
    with BufferingProxy(paced_server.port) as proxy:
        yield proxy


def test_probe_flags_a_buffering_proxy(paced_server: LiveServer, buffering_proxy) -> None:
    # Greedy: sampled, the random model can end on EOS after two tokens, a stream too short
    # for any buffer to show (CI saw one 6 ms long).
    direct = ProbeConfig(paced_server.url, model=MODEL_NAME, max_tokens=64, temperature=0)
    via_proxy = ProbeConfig(
        f"http://127.0.0.1:{buffering_proxy.port}", model=MODEL_NAME, max_tokens=64, temperature=0
    )
    check_direct(direct_run(direct).requests[0])
    probe = run_probe(via_proxy).requests[0]
    assert probe.error is None and probe.stamped_events > 0
    assert len(probe.token_received_s) >= 32, "the stream must be long enough to show a buffer"
    assert probe.buffering.detected is True, probe.buffering
    assert probe.proxy_headers == {"server": "zerohop", "via": "1.1 buffering-proxy"}


class ClosingProxy(BufferingProxy):
    """A proxy that closes each connection after its response (`connection: close`), as an
    HTTP/1.0-minded intermediary does: the client's socket is gone once the body is read."""

    headers = b"via: 1.1 closing-proxy\r\nconnection: close\r\n"


@pytest.fixture
def closing_proxy(live_server: LiveServer) -> Iterator[ClosingProxy]:
    with ClosingProxy(live_server.port, hold_s=0.01) as proxy:
        yield proxy


def test_probe_keeps_its_measurement_when_the_peer_closes(closing_proxy: ClosingProxy) -> None:
    # Was: OSError (Bad file descriptor) asking the closed socket for its peer, and nothing.
    url = f"http://127.0.0.1:{closing_proxy.port}"
    command = [sys.executable, "-m", "zerohop", "probe", url, "--json", "--max-tokens", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)["requests"][0]
    assert probe["status"] == 200 and probe["error"] is None
    assert probe["remote_address"] == f"127.0.0.1:{closing_proxy.port}"
    assert probe["proxy_headers"]["via"] == "1.1 closing-proxy"
    assert 0 < probe["ttfb_s"] <= probe["ttft_s"] <= probe["total_s"]
    assert len(probe["token_received_s"]) == probe["output_tokens"] > 0
