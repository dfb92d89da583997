"""`zerohop probe`: where the latency and the buffering of one streamed request come from.

One request (or `repeat`, on one pooled connection where the server keeps it open) is timed
phase by phase: DNS (resolved here, timed on its own, then the connection goes to that
address with the original Host and TLS server name, so `connect` is the TCP handshake
alone), TCP connect, TLS handshake, request written, response headers (TTFB), first token,
every gap after it. Connect, TLS, request and headers come from httpcore's trace hooks;
each body chunk is timed with `perf_counter` as httpcore hands it over and parsed only
after the stream has ended. The probe always asks for the server's send-time stamps
(zerohop.api.http.send_times) to tell an intermediary's buffering from the server's own pace.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2

from zerohop.bench.probe_analysis import Buffering, assess, clock_offset, gaps
from zerohop.bench.probe_endpoints import ENDPOINTS, Endpoint
from zerohop.bench.probe_sse import SseEvent, SseReader

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
PROXY_HEADERS = frozenset(
    {"via", "server", "age", "cf-ray", "cf-cache-status", "x-cache", "x-cache-hits"}
    | {"x-served-by", "x-timer", "fly-request-id", "x-vercel-id", "x-azure-ref"}
    | {"x-akamai-request-id", "content-encoding", "alt-svc"}
)
PROXY_HEADER_PREFIXES = ("x-envoy-", "x-amz-cf-", "x-forwarded-", "x-kong-", "x-cache-")


class ProbeError(Exception):
    """The probe could not run (said in one line)."""


@dataclass(slots=True)
class ProbeConfig:
    url: str
    endpoint: str = "openai-chat"
    model: str | None = None
    prompt: str = DEFAULT_PROMPT
    max_tokens: int = 64
    temperature: float | None = None  # None: the server's default
    api_key: str | None = None
    http2: bool = False
    repeat: int = 1
    insecure: bool = False
    timeout_s: float = 60.0


@dataclass(slots=True)
class RequestProbe:
    """One request's timeline; times in seconds from the request's start (DNS included)."""

    index: int
    status: int
    http_version: str
    reused_connection: bool
    remote_address: str | None
    tls_version: str | None
    dns_s: float | None
    connect_s: float | None
    tls_s: float | None
    request_sent_s: float | None
    ttfb_s: float | None
    ttft_s: float | None
    total_s: float
    output_tokens: int | None  # as the stream's usage reports it
    stamped_events: int
    token_received_s: list[float]
    token_sent_s: list[float] | None  # server send times on this axis, clock offset removed
    added_delay_s: list[float] | None  # receive - send - min(receive - send), per token
    gaps_s: list[float]
    proxy_headers: dict[str, str]
    buffering: Buffering
    error: str | None = None


@dataclass(slots=True)
class ProbeRun:
    url: str
    endpoint: str
    model: str
    requests: list[RequestProbe] = field(default_factory=list)


@dataclass(slots=True)
class _Trace:
    """httpcore trace hook: when each step (`connect_tcp.started`, ...) happened."""

    at: dict[str, float] = field(default_factory=dict)

    def __call__(self, name: str, info: dict[str, Any]) -> None:
        self.at.setdefault(name.partition(".")[2], time.perf_counter())

    def span(self, step: str) -> float | None:
        start, end = self.at.get(step + ".started"), self.at.get(step + ".complete")
        return None if start is None or end is None else end - start

    def since(self, step: str, origin: float) -> float | None:
        moment = self.at.get(step)
        return None if moment is None else moment - origin


@dataclass(slots=True, frozen=True)
class _Clock:
    """A request's time origin: `perf_counter` for durations, with the wall time it matches
    (server stamps are wall time)."""

    origin: float
    wall_origin: float

    @classmethod
    def start(cls) -> _Clock:
        return cls(time.perf_counter(), time.time())

    def now(self) -> float:
        return time.perf_counter() - self.origin


@dataclass(slots=True)
class _Stream:
    """What the probe keeps of one response's events (times from the request's start)."""

    endpoint: Endpoint
    clock: _Clock
    token_received: list[float] = field(default_factory=list)
    token_sent: list[float | None] = field(default_factory=list)
    stamped_received: list[float] = field(default_factory=list)
    stamped_sent: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    error: str | None = None

    def add(self, event: SseEvent) -> None:
        sent = None if event.sent is None else event.sent - self.clock.wall_origin
        if sent is not None:
            self.stamped_received.append(event.received)
            self.stamped_sent.append(sent)
        if event.data == "[DONE]":
            return
        try:
            data = json.loads(event.data)
        except ValueError:
            return
        if event.name == "error" or (isinstance(data, dict) and "error" in data):
            self.error = f"stream error: {event.data[:300]}"
        elif self.endpoint.is_token(event.name, data):
            self.token_received.append(event.received)
            self.token_sent.append(sent)
        elif (used := self.endpoint.output_tokens(event.name, data)) is not None:
            self.output_tokens = used

    def aligned_sends(self) -> tuple[list[float] | None, list[float] | None]:
        """Token send times on the client's axis and each token's added delay, or (None,
        None) unless every token was stamped."""
        offset = clock_offset(self.stamped_received, self.stamped_sent)
        if offset is None or any(sent is None for sent in self.token_sent):
            return None, None
        sent = [s + offset for s in self.token_sent]  # type: ignore[operator]
        delays = [r - s for r, s in zip(self.token_received, sent, strict=True)]
        return sent, delays


@dataclass(slots=True)
class _Exchange:
    """One request: its trace, response and events."""

    clock: _Clock
    stream: _Stream
    trace: _Trace = field(default_factory=_Trace)
    response: httpx2.Response | None = None
    peer: str | None = None  # read while the connection is open: a closed socket has none
    tls_version: str | None = None
    arrivals: list[tuple[float, bytes]] = field(default_factory=list)
    stamps: int = 0
    ended: float = 0.0
    error: str | None = None


def run_probe(config: ProbeConfig) -> ProbeRun:
    endpoint = _endpoint(config.endpoint)
    base = httpx2.URL(config.url)
    if base.scheme not in ("http", "https") or not base.host:
        raise ProbeError(f"not an http(s) URL: {config.url}")
    model = config.model or first_model(config, base)
    run = ProbeRun(str(base), config.endpoint, model)
    body = endpoint.body(model, config.prompt, config.max_tokens)
    if config.temperature is not None:
        body["temperature"] = config.temperature
    address: str | None = None
    with _client(config, base) as client:
        for index in range(config.repeat):
            clock, dns_s = _Clock.start(), None
            if address is None:  # once, as a client caching the answer would
                address = _resolve(base)
                dns_s = clock.now()
            exchange = _Exchange(clock, _Stream(endpoint, clock))
            _send(client, config, base, address, body, exchange)
            run.requests.append(_record(exchange, index, dns_s))
            if run.requests[-1].error is not None:
                break
    return run


def _endpoint(name: str) -> Endpoint:
    if name not in ENDPOINTS:
        raise ProbeError(f"unknown endpoint {name!r}: one of {', '.join(ENDPOINTS)}")
    return ENDPOINTS[name]


def _client(config: ProbeConfig, base: httpx2.URL) -> httpx2.Client:
    prior_knowledge = config.http2 and base.scheme == "http"  # h2c: no ALPN to negotiate
    return httpx2.Client(
        http1=not prior_knowledge,
        http2=config.http2,
        verify=not config.insecure,
        trust_env=False,  # straight to the URL: an environment proxy would hide the path
        timeout=config.timeout_s,
    )


def _auth_headers(config: ProbeConfig) -> dict[str, str]:
    if not config.api_key:
        return {}
    return {"authorization": f"Bearer {config.api_key}", "x-api-key": config.api_key}


def first_model(config: ProbeConfig, base: httpx2.URL) -> str:
    """The first model of GET /v1/models, on a connection of its own (not the probed one)."""
    url = base.copy_with(path=_api_path(base, "/v1/models"))
    with httpx2.Client(verify=not config.insecure, trust_env=False, timeout=30) as client:
        try:
            response = client.get(url, headers=_auth_headers(config))
        except httpx2.HTTPError as exc:
            raise ProbeError(f"GET {url}: {exc}") from exc
    if response.status_code != 200:
        raise ProbeError(f"GET {url}: HTTP {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise ProbeError(f"GET {url} lists no model: pass --model")
    return str(models[0]["id"])


def _api_path(base: httpx2.URL, path: str) -> str:
    return base.path.rstrip("/").removesuffix("/v1") + path


def _resolve(base: httpx2.URL) -> str:
    port = base.port or (443 if base.scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(base.host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ProbeError(f"cannot resolve {base.host}: {exc}") from exc
    return str(found[0][4][0])


def _send(
    client: httpx2.Client,
    config: ProbeConfig,
    base: httpx2.URL,
    address: str,
    body: dict[str, Any],
    exchange: _Exchange,
) -> None:
    endpoint = exchange.stream.endpoint
    url = base.copy_with(host=address, path=_api_path(base, endpoint.path))
    headers = {
        "host": base.netloc.decode("ascii"),
        "zerohop-send-times": "1",
        "accept": "text/event-stream",
        "accept-encoding": "identity",  # a compressed stream is buffered by its codec
        **_auth_headers(config),
        **endpoint.extra_headers,
    }
    extensions: dict[str, Any] = {"trace": exchange.trace}
    if base.scheme == "https":
        extensions["sni_hostname"] = base.host  # the certificate is checked against it too
    try:
        with client.stream(
            "POST", url, json=body, headers=headers, extensions=extensions
        ) as response:
            exchange.response = response
            _note_connection(response, exchange)
            _read(response, exchange)
    except httpx2.HTTPError as exc:
        exchange.error = f"{type(exc).__name__}: {exc}"
    exchange.ended = exchange.clock.now()
    _parse(exchange)


def _note_connection(response: httpx2.Response, exchange: _Exchange) -> None:
    """The peer's address and TLS version, asked of the socket before the body is read: a
    peer that closes after the response (`connection: close`) leaves no socket to ask."""
    exchange.peer = _address(_extra(response, "server_addr"))
    ssl_object = _extra(response, "ssl_object")
    exchange.tls_version = None if ssl_object is None else ssl_object.version()


def _read(response: httpx2.Response, exchange: _Exchange) -> None:
    if response.status_code != 200:
        text = response.read().decode("utf-8", "replace")
        exchange.error = f"HTTP {response.status_code}: {text[:300]}"
        return
    # Only note the time while reading: parsing here would delay the next read and blur
    # the arrival times of events that came in together.
    arrivals, clock = exchange.arrivals, exchange.clock
    for chunk in response.iter_bytes():
        arrivals.append((clock.now(), chunk))


def _parse(exchange: _Exchange) -> None:
    reader = SseReader()
    for received, chunk in exchange.arrivals:
        for event in reader.feed(chunk, received):
            exchange.stream.add(event)
    exchange.stamps = reader.stamps_seen


def _record(exchange: _Exchange, index: int, dns_s: float | None) -> RequestProbe:
    trace, stream, response = exchange.trace, exchange.stream, exchange.response
    origin = exchange.clock.origin
    received = stream.token_received
    sent, delays = stream.aligned_sends()
    headers_at = trace.since("receive_response_headers.complete", origin)
    return RequestProbe(
        index=index,
        status=0 if response is None else response.status_code,
        http_version="" if response is None else response.http_version,
        reused_connection="connect_tcp.started" not in trace.at,
        remote_address=exchange.peer,
        tls_version=exchange.tls_version,
        dns_s=dns_s,
        connect_s=trace.span("connect_tcp"),
        tls_s=trace.span("start_tls"),
        request_sent_s=trace.since("send_request_body.complete", origin),
        ttfb_s=headers_at,
        ttft_s=received[0] if received else None,
        total_s=exchange.ended,
        output_tokens=stream.output_tokens,
        stamped_events=exchange.stamps,
        token_received_s=received,
        token_sent_s=sent,
        added_delay_s=delays,
        gaps_s=gaps(received),
        proxy_headers=_proxy_headers(response),
        buffering=assess(headers_at, received, sent),
        error=exchange.error or stream.error,
    )


def _extra(response: httpx2.Response, name: str) -> Any:
    stream = response.extensions.get("network_stream")
    try:
        return None if stream is None else stream.get_extra_info(name)
    except OSError:  # the connection is already gone: the fact is unknown, not an error
        return None


def _address(peer: Any) -> str | None:
    if not peer:
        return None
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _proxy_headers(response: httpx2.Response | None) -> dict[str, str]:
    if response is None:
        return {}
    return {
        name: value
        for name, value in ((k.lower(), v) for k, v in response.headers.items())
        if name in PROXY_HEADERS or name.startswith(PROXY_HEADER_PREFIXES)
    }
