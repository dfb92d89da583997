"""The budget ledger never under-counts: real SQLite files, real disk errors, real crashes.

Disk errors are real ones, not mocks: RLIMIT_FSIZE set to the size the ledger's WAL file has
now, so SQLite's next commit cannot grow it and fails with EFBIG (Python ignores SIGXFSZ, so
the write returns the error instead of ending the process). In this process for the ledger
classes (the WAL is grown first, past anything pytest writes meanwhile); on a running server's
API process (`prlimit`) for the live tests. Lifting the limit is the disk taking writes again.

- A reservation that cannot be written refuses its request and is never refunded; a
  settlement that cannot be written is kept and written once the disk takes it; settling a
  request twice refunds once.
- `--durability`: the writer's connection runs `synchronous=FULL` or `NORMAL`.
- A live server with a failing key store refuses budgeted requests with a 503 in each API's
  shape while /health stays up and unbudgeted keys are served (`--ledger-failure open`, the
  default); `closed` refuses those too.
- SIGKILL of the whole server (API and engine process) during 32 budgeted streams: after a
  restart, durable spend >= what the clients received and <= the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import resource
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop import sse
from zerohop.cli import main as zerohop_main
from zerohop.gateway.auth import Authenticator
from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger, LedgerUnavailable, Reservation
from zerohop.gateway.budgets.sqlite_writer import RETRY_SECONDS, LedgerWriter, SettleOp
from zerohop.gateway.gateway import Call, Gateway, GatewayError
from zerohop.gateway.keys.identity import Budget, Identity, Limits, Tenant
from zerohop.gateway.store.repositories import LedgerRepository
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store

FSIZE = resource.RLIMIT_FSIZE
BUDGETED = Identity("zh-budget1", Tenant("t-budget"), budget=Budget(100_000))
UNBUDGETED = Identity("zh-free001", Tenant("t-free"), limits=Limits(rpm=100))
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]
IGNORE_EOS = {"ignore_eos": True}
TRACEBACK_MARKS = ("Traceback", 'File "', ".py", "sqlite3", "OperationalError", "EFBIG")


# -- helpers ----------------------------------------------------------------------------------


def wal(db: Path) -> Path:
    return db.with_name(db.name + "-wal")


@contextlib.contextmanager
def disk_full(db: Path, pid: int = 0) -> Iterator[None]:
    """Process `pid` (0: this one) can grow no file past the size `db`'s WAL has now."""
    soft, hard = resource.prlimit(pid, FSIZE)
    resource.prlimit(pid, FSIZE, (wal(db).stat().st_size, hard))
    try:
        yield
    finally:
        resource.prlimit(pid, FSIZE, (soft, hard))


def durable_spend(db: Path) -> dict[tuple[str, str], int]:
    """The ledger's rows, read through a read-only connection (it writes nothing itself)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {(s, p): t for s, p, t in conn.execute("SELECT subject, period, tokens FROM spend")}
    finally:
        conn.close()


def wait_until(check: Callable[[], Any], timeout: float = 5.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


async def await_until(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


def ledger_of(db: Path) -> LedgerRepository:
    """The ledger repository of the store on `db` (the process's one store, as served)."""
    return Store.of(StoreSpec.sqlite(db)).ledger


def fresh_ledger(tmp_path: Path, durability: str = "full") -> tuple[BudgetLedger, Path]:
    db = tmp_path / "keys.db"
    KeyStore(db).close()
    ledger = BudgetLedger(ledger_of(db), durability)  # type: ignore[arg-type]
    ledger.start()
    return ledger, db


async def served(ledger: BudgetLedger, request_id: str, prompt: int, used: int) -> Reservation:
    """What a served request does to the ledger: reserve, await durability, settle."""
    reservation = ledger.reserve(BUDGETED, request_id, prompt, 100)
    assert reservation is not None
    await ledger.confirm(reservation)
    reservation.used = used
    ledger.settle(reservation)
    return reservation


async def grow_wal(ledger: BudgetLedger, db: Path, size: int = 256 * 1024) -> int:
    """Served requests until the WAL is past `size` (and past anything pytest writes while a
    test holds the limit); returns the tokens they used."""
    n = 0
    while not wal(db).exists() or wal(db).stat().st_size < size:
        await served(ledger, f"req_grow{n}", 10, 10)
        await asyncio.sleep(0.002)  # the settle's own commit
        n += 1
    await asyncio.sleep(0.1)  # the last settlement written
    return 10 * n


def key_total(db: Path) -> int:
    return durable_spend(db).get((f"key:{BUDGETED.key_id}", "total"), 0)


# -- the ledger classes on a real SQLite file ----------------------------------------------------


def test_a_reservation_that_cannot_be_written_is_refused_and_never_refunded(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        ledger, db = fresh_ledger(tmp_path)
        used = await grow_wal(ledger, db)
        before = dict(ledger.spent)
        with disk_full(db):
            reservation = ledger.reserve(BUDGETED, "req_refused", 100, 100)
            assert reservation is not None
            with pytest.raises(LedgerUnavailable):
                await ledger.confirm(reservation)
            assert ledger.failing
            assert dict(ledger.spent) == before  # taken back at once
        # The request's normal finish settles it: nothing to give back, in memory or on disk.
        ledger.settle(reservation)
        assert dict(ledger.spent) == before
        assert await await_until(lambda: not ledger.failing, RETRY_SECONDS + 3)
        await served(ledger, "req_after", 20, 25)  # the disk takes writes again
        ledger.close()
        assert key_total(db) == used + 25
        assert ledger.spent[(f"key:{BUDGETED.key_id}", "total")] == used + 25

    asyncio.run(run())


def test_a_settlement_that_cannot_be_written_is_kept_and_written_later(tmp_path: Path) -> None:
    async def run() -> None:
        ledger, db = fresh_ledger(tmp_path)
        used = await grow_wal(ledger, db)
        reservation = ledger.reserve(BUDGETED, "req_kept", 50, 100)
        assert reservation is not None
        await ledger.confirm(reservation)
        with disk_full(db):
            reservation.used = 70
            ledger.settle(reservation)
            assert await await_until(lambda: ledger.failing)
            # Not written yet: the whole reservation stays counted (over, never under).
            assert key_total(db) == used + 150
        assert await await_until(lambda: not ledger.failing, RETRY_SECONDS + 3)
        assert wait_until(lambda: key_total(db) == used + 70)
        ledger.close()
        assert key_total(db) == used + 70

    asyncio.run(run())


def test_settling_a_request_twice_refunds_once(tmp_path: Path) -> None:
    async def run() -> None:
        ledger, db = fresh_ledger(tmp_path)
        reservation = await served(ledger, "req_twice", 10, 30)  # reserved 110, used 30
        ledger.settle(reservation)  # the same request's second finish
        # A second reservation under the same request id is not its request's own: settling
        # it gives nothing back (its tokens stay counted).
        again = ledger.reserve(BUDGETED, "req_again", 10, 100)
        assert again is not None
        await ledger.confirm(again)
        twin = ledger.reserve(BUDGETED, "req_again", 10, 100)
        assert twin is not None
        await ledger.confirm(twin)
        again.used = 40
        ledger.settle(again)
        ledger.settle(twin)
        ledger.close()
        assert key_total(db) == 30 + 40 + 110
        assert ledger.spent[(f"key:{BUDGETED.key_id}", "total")] == 30 + 40 + 110

    asyncio.run(run())


def test_the_writer_refunds_a_request_id_once_and_only_if_durably_reserved(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        ledger, db = fresh_ledger(tmp_path)
        reservation = ledger.reserve(BUDGETED, "req_w", 10, 100)
        assert reservation is not None
        await ledger.confirm(reservation)
        charges = reservation.charges
        for _ in range(3):  # the same settlement three times, straight to the writer
            ledger.writer.submit(SettleOp("req_w", charges, 60))
        ledger.writer.submit(SettleOp("req_never_reserved", charges, 0))
        ledger.close()
        assert key_total(db) == 60  # 110 reserved, 50 given back once, nothing for the other

    asyncio.run(run())


def test_a_crash_before_the_settlement_leaves_the_reservation_counted(tmp_path: Path) -> None:
    async def run() -> None:
        ledger, _ = fresh_ledger(tmp_path)
        reservation = ledger.reserve(BUDGETED, "req_cut", 10, 100)
        assert reservation is not None
        await ledger.confirm(reservation)
        ledger.close()  # the process ends here: no settlement

    asyncio.run(run())
    db = tmp_path / "keys.db"
    restarted = BudgetLedger(ledger_of(db))
    restarted.start()
    assert restarted.spent[(f"key:{BUDGETED.key_id}", "total")] == 110
    restarted.close()
    assert key_total(db) == 110


@pytest.mark.parametrize(("durability", "pragma"), [("normal", 1), ("full", 2)])
def test_durability_sets_the_ledger_connection_synchronous(
    tmp_path: Path, durability: str, pragma: int
) -> None:
    db = tmp_path / "keys.db"
    writer = LedgerWriter(ledger_of(db), durability)  # type: ignore[arg-type]
    writer.start()
    try:
        assert writer.synchronous == pragma
    finally:
        writer.close()


def test_the_default_durability_is_full(tmp_path: Path) -> None:
    assert BudgetLedger(ledger_of(tmp_path / "keys.db")).durability == "full"
    args = _serve_parser().parse_args(["serve"])
    assert (args.durability, args.ledger_failure) == ("full", "open")


def _serve_parser() -> Any:
    from zerohop.cli import build_parser

    return build_parser()


# -- the gateway on a failing ledger -------------------------------------------------------------


def _gateway(tmp_path: Path, policy: str) -> tuple[Gateway, Path]:
    ledger, db = fresh_ledger(tmp_path)
    store = Store.of(StoreSpec.sqlite(db))
    return Gateway(store, Authenticator(db, store.keys), ledger, ledger_failure=policy), db


def _call(identity: Identity) -> Call:
    return Call(f"req_{os.urandom(6).hex()}", "openai", identity=identity)


@pytest.mark.parametrize("policy", ["open", "closed"])
def test_the_gateway_fails_closed_for_budgets_and_as_told_for_the_rest(
    tmp_path: Path, policy: str
) -> None:
    budgeted = Identity(
        "zh-gwbudget", Tenant("t-gw-b", Limits(rpm=10)), budget=Budget(1000), limits=Limits(rpm=5)
    )

    async def run() -> None:
        gateway, db = _gateway(tmp_path, policy)
        assert gateway.ledger is not None
        await grow_wal(gateway.ledger, db)
        rpm_before = gateway.rate_state(_call(budgeted))["requests"].remaining
        with disk_full(db):
            call = _call(budgeted)
            with pytest.raises(GatewayError) as refused:
                await gateway.admit(call, 20, 50)
            error = refused.value
            assert (error.status, error.reason, error.code) == (503, "ledger", "ledger_unavailable")
            assert error.should_retry is True and error.retry_after is not None
            assert "ledger" in error.message
            assert not any(mark in error.message for mark in TRACEBACK_MARKS)
            assert call.reservation is None and not call.admitted and call.prompt_tokens == 0
            gateway.finish(call, 503, "ledger")  # as the surfaces end a refused request
            # The refusal used none of the key's or the tenant's requests.
            assert gateway.rate_state(_call(budgeted))["requests"].remaining == rpm_before
            free = _call(UNBUDGETED)
            if policy == "open":
                assert await gateway.admit(free, 20, 50) == 50
                gateway.finish(free, 200)
            else:
                with pytest.raises(GatewayError) as closed:
                    await gateway.admit(free, 20, 50)
                assert closed.value.status == 503 and not free.admitted
        assert await await_until(lambda: not gateway.ledger.failing, RETRY_SECONDS + 3)
        free = _call(UNBUDGETED)  # closed or open: served again
        assert await gateway.admit(free, 20, 50) == 50
        gateway.finish(free, 200)
        spent_before = key_spend_of(db, budgeted)
        await gateway.close()
        assert key_spend_of(db, budgeted) == spent_before == 0  # refused: nothing spent

    asyncio.run(run())


def key_spend_of(db: Path, identity: Identity) -> int:
    return durable_spend(db).get((f"key:{identity.key_id}", "total"), 0)


# -- live servers ---------------------------------------------------------------------------------


def cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = zerohop_main(list(args))
    assert rc == 0, (args, out.getvalue())
    return out.getvalue()


def create_key(db: Path, tenant: str, *flags: str) -> dict:
    return json.loads(
        cli("keys", "create", "--tenant", tenant, *flags, "--keys-db", str(db), "--json")
    )


def usage_of(db: Path, key: dict) -> int:
    """The key's total durable spend, from `zerohop keys usage --json`."""
    rows = json.loads(cli("keys", "usage", "--keys-db", str(db), "--json"))
    mine = [r for r in rows if r["subject"] == f"key:{key['key_id']}" and r["period"] == "total"]
    return mine[0]["tokens"] if mine else 0


def engine_pid(server: LiveServer) -> int:
    assert server.process is not None
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def assert_clean_error(body: dict, status: int) -> None:
    text = json.dumps(body)
    assert not any(mark in text for mark in TRACEBACK_MARKS), text
    assert "ledger" in text, text
    assert status == 503


def test_a_failing_key_store_refuses_budgeted_requests_cleanly_and_health_stays_up(
    llama_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "keys.db"
    budgeted = create_key(db, "disk-budget", "--budget", "100000")
    free = create_key(db, "disk-free")
    server = LiveServer(llama_dir, ["--keys-db", str(db), "--no-audit"])
    server.start(tmp_path / "server.log")
    assert server.process is not None
    anth = anthropic.Anthropic(base_url=server.url, api_key=budgeted["key"], max_retries=0)
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=budgeted["key"], max_retries=0)
    used = 0
    try:
        for _ in range(3):  # the ledger's WAL has some commits in it
            message = anth.messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
            used += message.usage.input_tokens + message.usage.output_tokens
        time.sleep(0.3)  # the last settlement written
        with disk_full(db, server.process.pid):
            with pytest.raises(anthropic.APIStatusError) as refused:
                anth.messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
            response = refused.value.response
            assert_clean_error(response.json(), response.status_code)
            assert response.json()["error"]["type"] == "overloaded_error"
            assert response.headers["x-should-retry"] == "true"
            assert int(response.headers["retry-after"]) >= 1
            with pytest.raises(openai.APIStatusError) as refused_oai:
                oai.chat.completions.create(
                    model=MODEL_NAME, max_tokens=4, messages=CHAT, stream=True
                )
            response = refused_oai.value.response
            response.read()
            assert_clean_error(response.json(), response.status_code)
            assert response.json()["error"]["code"] == "ledger_unavailable"
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            assert httpx.get(server.url + "/ready", timeout=5).status_code == 200
            # A key without a budget is served (--ledger-failure open, the default).
            answer = openai.OpenAI(
                base_url=server.url + "/v1", api_key=free["key"], max_retries=0
            ).chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
            assert answer.usage.completion_tokens >= 1

        # The disk takes writes again: budgeted requests are served again, within seconds.
        def served_again() -> Any:
            with contextlib.suppress(anthropic.APIStatusError):
                return anth.messages.create(model=MODEL_NAME, max_tokens=4, messages=CHAT)
            return None

        message = wait_until(served_again, timeout=10, every=0.2)
        assert message is not None, server.log()
        used += message.usage.input_tokens + message.usage.output_tokens
    finally:
        code = server.stop()
    assert code == 0
    # Exactly what the served requests used: the refusals reserved and refunded nothing.
    assert usage_of(db, budgeted) == used
    assert "Traceback" not in server.log()


def test_ledger_failure_closed_refuses_unbudgeted_requests_too(
    llama_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "keys.db"
    budgeted = create_key(db, "closed-budget", "--budget", "100000")
    free = create_key(db, "closed-free")
    args = ["--keys-db", str(db), "--no-audit", "--ledger-failure", "closed"]
    server = LiveServer(llama_dir, args).start(tmp_path / "server.log")
    assert server.process is not None

    def post(key: dict) -> httpx.Response:
        body = {"model": MODEL_NAME, "max_tokens": 4, "messages": CHAT}
        headers = {"x-api-key": key["key"]}
        return httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)

    try:
        assert post(budgeted).status_code == 200
        time.sleep(0.3)
        with disk_full(db, server.process.pid):
            assert post(budgeted).status_code == 503  # the ledger is failing now
            refused = post(free)
            assert_clean_error(refused.json(), refused.status_code)
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert wait_until(lambda: post(free).status_code == 200, timeout=10, every=0.2)
    finally:
        assert server.stop() == 0


# -- SIGKILL of the whole server during 32 budgeted streams --------------------------------------

STREAMS = 32
CRASH_BUDGET = 2400
STEP_DELAY = 0.05


async def _stream(
    client: httpx.AsyncClient, url: str, key: str, max_tokens: int, state: dict[str, Any]
) -> None:
    """One streamed chat completion; `state`: what the client received before it ended or
    broke (output token ids, and the uncached prompt tokens its final usage reports)."""
    state.update(status=None, input=0, output=0, done=False)
    body = {
        "model": MODEL_NAME, "max_tokens": max_tokens, "messages": CHAT, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True, **IGNORE_EOS,
    }  # fmt: skip
    try:
        async with client.stream("POST", url, json=body, headers={"x-api-key": key}) as response:
            state["status"] = response.status_code
            if response.status_code != 200:
                return
            async for event in sse.aevents(response.aiter_bytes()):
                if event.data == b"[DONE]":
                    state["done"] = True
                    break
                chunk = json.loads(event.data)
                for choice in chunk["choices"]:
                    state["output"] += len(choice.get("token_ids") or [])
                if usage := chunk.get("usage"):
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    state["input"] = usage["prompt_tokens"] - cached
    except httpx.HTTPError as exc:
        state["error"] = repr(exc)


def _kill_when_cut(states: list[dict[str, Any]]) -> bool:
    """Some streams finished and the long ones well into their answers: the moment."""
    done = sum(s.get("done", False) for s in states)
    cut = [s for s in states if s.get("status") == 200 and not s.get("done")]
    return done >= 3 and len(cut) >= 3 and all(s["output"] >= 5 for s in cut)


def test_sigkill_of_the_whole_server_during_32_streams_never_under_counts(
    llama_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "keys.db"
    key = create_key(db, "crash", "--budget", str(CRASH_BUDGET))
    args = ["--keys-db", str(db), "--no-audit", "--durability", "normal"]
    slow = [*args, "--debug-step-delay", str(STEP_DELAY)]
    server = LiveServer(llama_dir, slow).start(tmp_path / "server.log")
    assert server.process is not None
    api, engine = server.process.pid, engine_pid(server)
    url = server.url + "/v1/chat/completions"
    states: list[dict[str, Any]] = [{} for _ in range(STREAMS)]

    async def run() -> None:
        limits = httpx.Limits(max_connections=STREAMS + 4)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            # A quarter ask for 4 tokens (done before the kill), then the rest for 200 (10 s
            # at 0.05 s a step): the budget admits the short ones and some of the long ones.
            tasks = []
            for i, state in enumerate(states):
                max_tokens = 4 if i < STREAMS // 4 else 200
                tasks.append(
                    asyncio.create_task(_stream(client, url, key["key"], max_tokens, state))
                )
                await asyncio.sleep(0.01)  # arrival in this order
            await await_until(lambda: _kill_when_cut(states), timeout=30)
            os.kill(api, signal.SIGKILL)  # the whole server at once: no refund gets out
            os.kill(engine, signal.SIGKILL)
            await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
    served = [s for s in states if s["status"] == 200]
    cut = [s for s in served if not s["done"]]
    assert _kill_when_cut(states) or (cut and all(s["output"] for s in cut)), states
    assert len(served) < STREAMS, states  # the budget refused some: it binds
    received = sum(s["input"] + s["output"] for s in served)

    restarted = LiveServer(llama_dir, args).start(tmp_path / "restarted.log")
    try:
        spent = usage_of(db, key)
        assert received <= spent <= CRASH_BUDGET, (received, spent)
        # The restarted server counts that spend: what is left is all it grants.
        body = {"model": MODEL_NAME, "max_tokens": 1000, "messages": CHAT, **IGNORE_EOS}
        headers = {"x-api-key": key["key"]}
        response = httpx.post(
            restarted.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
        )
        if response.status_code == 200:
            usage = response.json()["usage"]
            left = CRASH_BUDGET - spent - usage["prompt_tokens"]
            assert usage["completion_tokens"] == min(1000, left)
        else:
            assert response.status_code == 429, response.text
    finally:
        assert restarted.stop() == 0
    assert usage_of(db, key) <= CRASH_BUDGET
