"""Message threads on the Anthropic surface (anthropic/threads.py): the thread table in both
stores (SQLite and a real PostgreSQL), the thread's bounds, and a keyed `zerohop serve` on
the tiny random model continuing threads over the anthropic SDK: the prompt grows with the
kept turns, another tenant's thread is a 404, each response continues once, streamed turns
are kept too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.anthropic.schema import decode_messages
from zerohop.api.anthropic.threads import ThreadOptions, Threads
from zerohop.api.errors import ApiError
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store
from zerohop.gateway.store.thread_tables import NewThreadRow, Taken

BETA = "message-threads-2026-08-12"
TTL = 60.0


# -- the table, in either store -------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        opened: Any = KeyStore(tmp_path / "keys.db")
    else:
        from tests.pg_fixtures import migrated_database
        from zerohop.gateway.store.postgres import PostgresStore

        opened = PostgresStore(migrated_database(request.getfixturevalue("postgres")))
    yield opened
    opened.close()


def row(message_id: str, continues: str | None = None, body: str | None = "{}") -> NewThreadRow:
    size = len(body or "")
    return NewThreadRow(message_id, "acme", body, size, 1, continues)


def test_a_thread_row_is_its_tenants_and_continues_once(store: Any) -> None:
    store.put_thread(row("msg_1"), 100.0, TTL)
    assert store.take_thread("other", "msg_1", 101.0, TTL) == Taken("not_found")
    assert store.take_thread("acme", "msg_unknown", 101.0, TTL) == Taken("not_found")
    assert store.take_thread("acme", "msg_1", 101.0, TTL) == Taken("taken", "{}", 1)
    assert store.take_thread("acme", "msg_1", 102.0, TTL).outcome == "in_flight"
    store.release_thread("other", "msg_1", 103.0)  # not its own: nothing changes
    assert store.take_thread("acme", "msg_1", 103.0, TTL).outcome == "in_flight"
    store.release_thread("acme", "msg_1", 103.0)  # the answer failed: open again
    assert store.take_thread("acme", "msg_1", 104.0, TTL).outcome == "taken"
    store.put_thread(row("msg_2", continues="msg_1"), 105.0, TTL)
    assert store.take_thread("acme", "msg_1", 106.0, TTL).outcome == "continued"
    assert store.take_thread("acme", "msg_2", 106.0, TTL).outcome == "taken"


def test_a_thread_expires_and_a_too_large_one_is_a_tombstone(store: Any) -> None:
    store.put_thread(row("msg_old"), 100.0, TTL)
    store.put_thread(row("msg_big", body=None), 100.0, TTL)
    assert store.take_thread("acme", "msg_big", 101.0, TTL).outcome == "too_large"
    assert store.take_thread("acme", "msg_old", 100.0 + TTL + 1, TTL) == Taken("not_found")
    store.put_thread(row("msg_new"), 100.0 + TTL + 1, TTL)  # each write drops expired rows
    assert store.take_thread("acme", "msg_old", 100.0, TTL) == Taken("not_found")


# -- a request's turn on a thread (no server) -------------------------------------------------


def body(**fields: Any) -> bytes:
    import orjson

    return orjson.dumps({"model": MODEL_NAME, "max_tokens": 4, **fields})


def begin(threads: Threads, raw: bytes, tenant: str = "acme") -> Any:
    return asyncio.run(threads.begin(decode_messages(raw), raw, tenant))


def test_a_continue_gets_the_kept_turns_system_and_tools_first(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    threads = Threads(store.threads, ThreadOptions())
    tool = {"name": "t", "input_schema": {"type": "object"}}
    first = body(
        messages=[{"role": "user", "content": "one"}],
        system="be brief",
        tools=[tool],
        thread={"type": "create"},
    )
    request, turn = begin(threads, first)
    assert turn.continues is None and len(request.messages) == 1
    asyncio.run(turn.answered("msg_a", [{"type": "text", "text": "ok"}]))
    then = body(
        messages=[{"role": "user", "content": "two"}],
        thread={"type": "continue", "previous_message_id": "msg_a"},
    )
    request, turn = begin(threads, then)
    assert [m.role for m in request.messages] == ["user", "assistant", "user"]
    assert request.system == "be brief" and request.tools[0].name == "t"
    asyncio.run(turn.abandon())  # no answer: msg_a may be continued again
    changed = body(
        messages=[{"role": "user", "content": "two"}],
        system="be long",
        thread={"type": "continue", "previous_message_id": "msg_a"},
    )
    with pytest.raises(ApiError) as refused:
        begin(threads, changed)
    assert refused.value.details == {"error_code": "thread_fingerprint_mismatch"}
    with pytest.raises(ApiError) as other:
        begin(threads, then, tenant="other")
    assert (other.value.status, other.value.details) == (404, {"error_code": "thread_not_found"})
    request, turn = begin(threads, then)  # the refused ones gave msg_a back
    assert len(request.messages) == 3
    store.close()


def test_an_answer_past_the_size_limit_ends_the_thread(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    threads = Threads(store.threads, ThreadOptions(max_bytes=1024))
    _, turn = begin(
        threads, body(messages=[{"role": "user", "content": "x"}], thread={"type": "create"})
    )
    asyncio.run(turn.answered("msg_big", [{"type": "text", "text": "y" * 2000}]))
    then = body(messages=[], thread={"type": "continue", "previous_message_id": "msg_big"})
    with pytest.raises(ApiError) as refused:
        begin(threads, then)
    assert refused.value.status == 404 and "past the size" in refused.value.message
    store.close()


@pytest.mark.parametrize(
    "options", [{"max_bytes": 10}, {"max_bytes": 2**31}, {"max_bytes": True}, {"ttl_s": 0.0},
                {"ttl_s": float("nan")}],
)  # fmt: skip
def test_thread_options_are_validated(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="threads: "):
        ThreadOptions(**options)


# -- a keyed server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A server with a key of tenant acme and one of tenant other."""
    db = tmp_path_factory.mktemp("thread_keys") / "keys.db"
    store = KeyStore(db)
    keys = {tenant: store.create_key(tenant)[0] for tenant in ("acme", "other")}
    store.close()
    log = tmp_path_factory.mktemp("thread_server") / "server.log"
    server = LiveServer(llama_dir, ["--keys-db", str(db)]).start(log)
    yield {"server": server, "keys": keys}
    server.stop()


def client(keyed: dict[str, Any], tenant: str = "acme") -> anthropic.Anthropic:
    url = keyed["server"].url
    return anthropic.Anthropic(base_url=url, api_key=keyed["keys"][tenant], max_retries=0)


def create(c: anthropic.Anthropic, messages: list[dict[str, Any]], thread: dict[str, Any],
           **fields: Any) -> Any:  # fmt: skip
    return c.beta.messages.create(
        model=MODEL_NAME, max_tokens=3, messages=messages,  # type: ignore[arg-type]
        thread=thread, betas=[BETA], **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def prompt_tokens(message: Any) -> int:
    usage = message.usage
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_a_thread_continued_over_three_turns_grows_its_prompt(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    first = create(c, user("Name a colour."), {"type": "create"}, system="Answer briefly.")
    second = create(c, user("Another one."), {"type": "continue", "previous_message_id": first.id})
    third = create(c, user("And one more."), {"type": "continue", "previous_message_id": second.id})
    sizes = [prompt_tokens(m) for m in (first, second, third)]
    assert sizes[0] < sizes[1] < sizes[2], sizes
    # The third turn's prompt is the whole conversation, sent in one request without a thread.
    whole = c.messages.count_tokens(
        model=MODEL_NAME,
        system="Answer briefly.",
        messages=[
            *user("Name a colour."), {"role": "assistant", "content": first.content[0].text},  # type: ignore[union-attr]
            *user("Another one."), {"role": "assistant", "content": second.content[0].text},  # type: ignore[union-attr]
            *user("And one more."),
        ],  # type: ignore[list-item]
    )  # fmt: skip
    assert whole.input_tokens == sizes[2]


def test_another_tenants_thread_is_not_found(keyed: dict[str, Any]) -> None:
    mine = create(client(keyed), user("hi"), {"type": "create"})
    with pytest.raises(anthropic.NotFoundError) as refused:
        create(
            client(keyed, "other"), user("hi"), {"type": "continue", "previous_message_id": mine.id}
        )
    error = refused.value.body["error"]  # type: ignore[index]
    assert error["type"] == "not_found_error"
    assert error["details"] == {"error_code": "thread_not_found"}
    assert "hi" not in refused.value.response.text
    # Unharmed: its own tenant continues it.
    create(client(keyed), user("again"), {"type": "continue", "previous_message_id": mine.id})


def test_a_response_continues_once_and_a_streamed_answer_is_kept(keyed: dict[str, Any]) -> None:
    c = client(keyed)
    with c.beta.messages.stream(
        model=MODEL_NAME, max_tokens=3, messages=user("hi"),  # type: ignore[arg-type]
        thread={"type": "create"}, betas=[BETA],
    ) as stream:  # fmt: skip
        first = stream.get_final_message()
    after = create(c, user("more"), {"type": "continue", "previous_message_id": first.id})
    assert prompt_tokens(after) > prompt_tokens(first)
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(c, user("fork"), {"type": "continue", "previous_message_id": first.id})
    assert refused.value.body["error"]["details"]["error_code"] == "thread_already_continued"  # type: ignore[index]


def test_the_thread_helper_sends_only_new_messages(keyed: dict[str, Any]) -> None:
    """client.beta.messages.thread(): two turns, the second a continue the server answers."""
    c = client(keyed)
    thread = c.beta.messages.thread(model=MODEL_NAME, max_tokens=3, system="Be brief.")
    first = thread.send({"role": "user", "content": "hi"})
    second = thread.send({"role": "user", "content": "and?"})
    assert thread.previous_message_id == second.id  # continued, not replayed
    assert prompt_tokens(second) > prompt_tokens(first)


def test_a_cancelled_answer_is_not_kept(keyed: dict[str, Any]) -> None:
    """A continue whose stream the client drops keeps nothing: its response is continued
    again once the server has noticed (until then, the in-flight 400)."""
    import time

    c = client(keyed)
    first = create(c, user("hi"), {"type": "create"})
    thread = {"type": "continue", "previous_message_id": first.id}
    with c.beta.messages.stream(
        model=MODEL_NAME, max_tokens=200, messages=user("go on"),  # type: ignore[arg-type]
        thread=thread, betas=[BETA],  # type: ignore[arg-type]
    ) as stream:  # fmt: skip
        next(iter(stream))  # message_start, then the client goes
    deadline = time.monotonic() + 30
    while True:
        try:
            again = create(c, user("go on"), thread)
            break
        except anthropic.BadRequestError as exc:
            code = exc.body["error"]["details"]["error_code"]  # type: ignore[index]
            assert code == "thread_continue_in_flight" and time.monotonic() < deadline
            time.sleep(0.1)
    assert prompt_tokens(again) > prompt_tokens(first)
