"""Engine supervision end to end: a real `zerohop serve` whose engine process is killed
(kill -9, what the OOM killer does) fails the requests in flight clearly, restarts the
engine, counts it and serves again, with /health 200 all along; one whose engine cannot be
started again fails /health and exits non-zero. And the engine process's side of "one
request never kills the engine": a request it must refuse leaves its neighbours running."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.serving.service import ServingContext
from zerohop.app.routes import create_app
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.client import RequestOptions
from zerohop.engine.process.async_engine import AsyncEngine
from zerohop.engine.process.supervisor import EngineSupervisor, RestartPolicy
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.engine.text.tokenizer import Tokenizer

STEP_DELAY = "0.05"  # a 400-token stream runs 20 s: the kill lands while it streams
LONG = 400
SAFETY_TIMEOUT = 180.0  # a safety net against a hang only; nothing asserts on time
CHAT = [{"role": "user", "content": "Tell me a long story."}]
TRACEBACK_MARKS = ("Traceback", 'File "', ".py")


@pytest.fixture
def slow_server(llama_dir: Path, tmp_path: Path):
    server = LiveServer(llama_dir, ["--debug-step-delay", STEP_DELAY])
    server.start(tmp_path / "server.log")
    yield server
    server.stop()


def engine_pid(server: LiveServer) -> int:
    tasks = Path(f"/proc/{server.process.pid}/task").glob("*/children")
    (pid,) = [int(child) for task in tasks for child in task.read_text().split()]
    return pid


class HealthWatch:
    """Polls /health (or `path`) from a thread; `stop()` returns every answer (a status or
    an error)."""

    def __init__(self, url: str, path: str = "/health") -> None:
        self.url, self.answers = url + path, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> HealthWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:  # a loaded machine is slow, not unhealthy
            while not self._stop.is_set():
                try:
                    self.answers.append(client.get(self.url).status_code)
                except httpx.HTTPError as exc:
                    self.answers.append(type(exc).__name__)
                self._stop.wait(0.05)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(SAFETY_TIMEOUT)
        return self.answers


def _in_thread(target, *args) -> tuple[threading.Thread, dict]:
    outcome: dict = {"started": threading.Event()}

    def run() -> None:
        try:
            outcome["result"] = target(outcome["started"], *args)
        except Exception as exc:  # what the client saw: the test checks it
            outcome["error"] = exc
        finally:
            outcome["started"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _openai_stream(started: threading.Event, url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=LONG, stream=True,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = ""
    for chunk in stream:
        started.set()
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    return text


def _anthropic_stream(started: threading.Event, url: str) -> str | None:
    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
    stream = client.messages.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=LONG,
        stream=True,
        extra_body={"temperature": 0},
    )
    stop_reason = None
    for event in stream:
        started.set()
        if event.type == "message_delta":
            stop_reason = event.delta.stop_reason
    return stop_reason


def _openai_whole(started: threading.Event, url: str) -> httpx.Response:
    started.set()
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": LONG, "ignore_eos": True}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=SAFETY_TIMEOUT)


def _short(url: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/messages", json=body, timeout=SAFETY_TIMEOUT)


def _wait_running(url: str, runs: dict) -> None:
    deadline = time.monotonic() + SAFETY_TIMEOUT
    while httpx.get(url + "/engine/stats").json()["num_running"] < len(runs):
        for name, (thread, outcome) in runs.items():
            assert thread.is_alive(), (name, outcome)  # it ended before the kill
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)


def _check_clear(message: str) -> None:
    assert "restarting" in message, message
    assert not any(mark in message for mark in TRACEBACK_MARKS), message


def test_a_killed_engine_is_restarted_and_the_replica_serves_again(slow_server) -> None:
    url = slow_server.url
    baseline = _short(url)
    assert baseline.status_code == 200, baseline.text
    assert baseline.json()["stop_reason"] == "max_tokens"
    anthropic_greedy = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
    runs = {
        "openai-stream": _in_thread(_openai_stream, url),
        "anthropic-stream": _in_thread(_anthropic_stream, url),
        "openai-whole": _in_thread(_openai_whole, url),
    }
    for _, outcome in runs.values():
        assert outcome["started"].wait(SAFETY_TIMEOUT)
    _wait_running(url, runs)
    watch, ready = HealthWatch(url).start(), HealthWatch(url, "/ready").start()
    killed = engine_pid(slow_server)
    os.kill(killed, signal.SIGKILL)
    for thread, _ in runs.values():
        thread.join(SAFETY_TIMEOUT)
        assert not thread.is_alive(), "a request in flight hung"

    # Each request in flight ends with a clear error in its API's shape.
    error = runs["openai-stream"][1].get("error")
    assert isinstance(error, openai.APIError), runs["openai-stream"][1]
    _check_clear(error.message)
    error = runs["anthropic-stream"][1].get("error")
    assert isinstance(error, anthropic.APIStatusError), runs["anthropic-stream"][1]
    assert error.body["error"]["type"] == "overloaded_error"
    _check_clear(error.body["error"]["message"])
    whole = runs["openai-whole"][1]["result"]
    assert whole.status_code == 503 and whole.headers["x-should-retry"] == "true"
    assert int(whole.headers["retry-after"]) >= 1
    assert whole.json()["error"]["code"] == "unavailable"
    _check_clear(whole.json()["error"]["message"])

    # New requests are refused with 529 and retry-after until the new engine serves.
    deadline = time.monotonic() + SAFETY_TIMEOUT
    while (again := _short(url)).status_code != 200:
        assert again.status_code == 529, again.text
        assert again.json()["error"]["type"] == "overloaded_error"
        assert int(again.headers["retry-after"]) >= 1
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.1)
    assert again.json()["content"] == baseline.json()["content"]  # the same model, greedy
    message = anthropic_greedy.messages.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, extra_body={"temperature": 0}
    )
    assert message.content[0].text == baseline.json()["content"][0]["text"]
    assert httpx.get(url + "/ready").status_code == 200
    assert engine_pid(slow_server) != killed
    metrics = httpx.get(url + "/metrics").text
    assert "zerohop_engine_restarts_total 1.0" in metrics
    answers = watch.stop()
    assert answers and set(answers) == {200}, answers  # /health never failed: it recovered
    readiness = ready.stop()
    assert 503 in readiness and readiness[-1] == 200, readiness  # not ready while restarting
    log = slow_server.log()  # each start phase timed; the restart reuses the calibration
    assert "engine start: warm-up and step-time calibration in" in log
    assert "engine start: warm-up in" in log and "engine start: weights in" in log


@pytest.mark.parametrize("weights", ["missing", "hanging"])
def test_an_engine_that_cannot_restart_fails_health_and_exits_non_zero(
    llama_dir: Path, tmp_path: Path, weights: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    server = LiveServer(model, ["--engine-max-restarts", "2", "--engine-start-timeout", "4"])
    server.start(tmp_path / "server.log")
    try:
        # The running engine has its weights loaded; a new one cannot load them: they are
        # gone, or a FIFO nobody writes (the start hangs until --engine-start-timeout).
        (model / "model.safetensors").unlink()
        if weights == "hanging":
            os.mkfifo(model / "model.safetensors")
        watch = HealthWatch(server.url).start()
        os.kill(engine_pid(server), signal.SIGKILL)
        code = server.process.wait(SAFETY_TIMEOUT)
        answers = watch.stop()
    finally:
        server.stop()
    assert code == 1, server.log()
    log = server.log()
    assert "giving up on the engine: the engine failed to start 2 times in a row" in log
    assert "zerohop serve: exiting:" in log
    if weights == "hanging":
        assert "not ready within 4 s (--engine-start-timeout)" in log
    statuses = [a for a in answers if isinstance(a, int)]
    assert set(statuses) <= {200, 503}, answers
    assert 503 in statuses, answers  # it fails /health before it exits
    assert 200 not in statuses[statuses.index(503) :], answers  # and never says 200 again


class _GivenUp:
    """An engine supervisor that has given up, as far as the app reads one."""

    def __init__(self) -> None:
        self.gave_up = self.dead = "the engine failed to start 3 times in a row"
        self.latest_stats = None
        self.info: dict = {}

    async def stats(self) -> dict:
        from zerohop.engine.process.async_engine import EngineDeadError

        raise EngineDeadError(self.dead)


async def _get(app, path: str) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_health_fails_once_the_engine_is_given_up(llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(llama_dir)
    ctx = ServingContext(_GivenUp(), tokenizer, MODEL_NAME, 64)  # type: ignore[arg-type]
    app = create_app(ctx)
    assert asyncio.run(_get(app, "/health")) == (503, b'{"status":"failed"}')
    assert asyncio.run(_get(app, "/ready"))[0] == 503
    assert asyncio.run(_get(app, "/engine/stats"))[0] == 503


def test_a_request_the_engine_process_refuses_leaves_its_neighbours_running(
    llama_dir: Path,
) -> None:
    options = {"num_kv_blocks": 64, "num_threads": 1, "max_num_batched_tokens": 64}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run() -> tuple[list, list]:
        engine = await AsyncEngine.start(str(llama_dir), **options)
        try:
            before = [d async for d in engine.generate("before", [5, 6, 7], params)]
            stream = engine.generate("neighbour", [5, 6, 7], params)
            deltas = [await anext(stream)]
            for i, weight in enumerate((0, -1.0, float("nan"))):
                with pytest.raises(InvalidRequestError, match="weight"):
                    bad = RequestOptions(weight=weight)
                    async for _ in engine.generate(f"bad-{i}", [5], params, options=bad):
                        pass
            deltas += [d async for d in stream]
            return before, deltas
        finally:
            await engine.shutdown()

    before, neighbour = asyncio.run(run())
    assert neighbour[-1].finish_reason == "length" and neighbour[-1].error is None
    tokens = [t for d in neighbour for t in d.new_token_ids]
    assert tokens == [t for d in before for t in d.new_token_ids]


class _WatchBreaks:
    """An engine whose wait for its process's end fails in a way supervision does not expect."""

    dead = None

    async def wait_closed(self) -> str:
        raise RuntimeError("boom")

    async def shutdown(self, timeout: float = 10.0) -> None:
        return None


def test_an_error_in_supervision_gives_up_so_health_fails() -> None:
    # Not a silent end of supervision: the supervisor gives up, so /health fails and the
    # server exits for its orchestrator.
    async def run() -> tuple[str | None, list[str]]:
        given: list[str] = []
        supervisor = EngineSupervisor(_WatchBreaks(), "m", {}, RestartPolicy(), 1.0)  # type: ignore[arg-type]
        supervisor.on_give_up = given.append
        await asyncio.sleep(0.1)
        return supervisor.gave_up, given

    gave_up, given = asyncio.run(run())
    assert gave_up == "engine supervision failed: RuntimeError: boom" and given == [gave_up]


def test_an_engine_start_that_hangs_is_killed_at_the_timeout(
    llama_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")  # opened for reading, it waits for a writer

    async def start() -> None:
        await AsyncEngine.start(str(model), start_timeout=3.0)

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="not ready within 3 s"):
        asyncio.run(start())
    assert time.monotonic() - started < SAFETY_TIMEOUT
