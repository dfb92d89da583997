"""Thought signatures (issue 42): the server's signing keys in the key store (SQLite, or a fleet's
real PostgreSQL), a key id in each signature, rotation with an overlap, the MAC bound to model
and tenant, and a thinking block that does not verify left out of the prompt (or refused with
--strict-thought-signatures), while a verified one of the current tool loop is rendered as
Qwen3's template renders it.

Keys: rotation and expiry under a clock the test moves, one first key (and one next key) made
by replicas racing for it, a store that cannot be read, the operator's key. Prompts: the
conversation rendered by Qwen3's real template (tests/fixtures/qwen3_template.py) on the tiny
qwen3's tokenizer. Live: `zerohop serve` processes and the official anthropic SDK: a signature
made before a restart (and a key rotation) verifies after it on SQLite, and a signature made on
one PostgreSQL replica verifies on another; another tenant's and an edited thought are left
out of the prompt (count_tokens counts it) or refused when strict.
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import msgspec
import pytest

from tests.fixtures.qwen3_template import QWEN3_THINKING_TEMPLATE
from tests.live_server import LiveServer, with_chat_template
from zerohop.api.anthropic.schema import decode_messages
from zerohop.api.anthropic.turns import conversation
from zerohop.api.conversation.planner import prompt_ids
from zerohop.api.errors import ApiError
from zerohop.api.serving.service import ServingContext
from zerohop.api.serving.thought_signatures import (
    PURPOSE,
    ThoughtSignatures,
    ThoughtSigner,
)
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.server_keys import RETRY_INTERVAL, ServerKeys
from zerohop.gateway.store.repositories import SigningKeyRepository
from zerohop.gateway.store.spec import StoreUnavailable
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store

MODEL = "tiny-qwen3"
HOUR = 3600.0
THOUGHT = "the user wants the weather: call the tool"
QUESTION = "What is the weather?"
TOOL = {
    "name": "weather",
    "description": "The weather now",
    "input_schema": {"type": "object", "properties": {}},
}
ADAPTIVE = {"type": "adaptive"}


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def signer(
    keys: ServerKeys,
    tenant: str = "acme",
    model: str = MODEL,
    signatures: tuple[str, ...] = (),
    strict: bool = False,
) -> ThoughtSigner:
    """A request's signer, as the surface gets it (the keys read in this thread's own loop)."""
    signatures_ = ThoughtSignatures(keys, strict=strict)
    return asyncio.run(signatures_.signer(model, tenant, signatures, signs=True))


def sign(keys: ServerKeys, thought: str = THOUGHT, **kw: Any) -> str:
    return signer(keys, **kw).sign(thought)


def check(keys: ServerKeys, signature: str, thought: str = THOUGHT, **kw: Any) -> str:
    return signer(keys, signatures=(signature,), **kw).check(thought, signature)


def key_id(signature: str) -> str:
    return signature.partition(".")[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """Opens the store anew on each call, as a replica (or a restarted one) does."""
    if request.param == "sqlite":
        path = tmp_path / "keys.db"
        return lambda: KeyStore(path)
    from tests.pg_fixtures import migrated_database
    from zerohop.gateway.store.postgres import PostgresStore

    url = migrated_database(request.getfixturevalue("postgres"))
    return lambda: PostgresStore(url)


OPENED: list[Store] = []  # the stores over() opened, closed after each test


@pytest.fixture(autouse=True)
def _close_stores() -> Iterator[None]:
    yield
    while OPENED:
        OPENED.pop().close()


def over(opener: Callable[[], Any]) -> SigningKeyRepository:
    """The signing keys of a store of its own (a replica's, or a restarted one's)."""
    OPENED.append(Store(opener))
    return OPENED[-1].signing_keys


def stored(opener: Callable[[], Any]) -> list[tuple[int, str]]:
    store = opener()
    try:
        return [(r.generation, r.key_id) for r in store.signing_keys(PURPOSE)]
    finally:
        store.close()


# -- keys ------------------------------------------------------------------------------------


def test_a_signature_verifies_after_a_restart_and_through_a_rotation(
    opener: Callable[[], Any],
) -> None:
    clock = Clock()
    keys = ServerKeys(over(opener), PURPOSE, rotation=HOUR, clock=clock)
    first = sign(keys)
    restarted = ServerKeys(over(opener), PURPOSE, rotation=HOUR, clock=clock)
    assert check(restarted, first) == "verified"
    assert sign(restarted).partition(".")[0] == key_id(first)  # the same key signs
    assert stored(opener) == [(1, key_id(first))]

    clock.now += HOUR  # the key is a rotation old: the next signature makes the next key
    second = sign(keys)
    assert key_id(second) != key_id(first)
    assert stored(opener) == [(1, key_id(first)), (2, key_id(second))]
    # The other process learns of the new key when a signature names it, and rotates to it.
    assert check(restarted, second) == "verified"
    assert key_id(sign(restarted)) == key_id(second)
    for replica in (keys, restarted):  # the replaced key verifies for the overlap, no longer
        assert check(replica, first) == "verified"
    clock.now += HOUR - 1
    assert check(keys, first) == "verified" and check(restarted, first) == "verified"
    clock.now += 2  # the overlap is over, and the second key is a rotation old too
    assert check(keys, first) == "unknown_key" and check(restarted, first) == "unknown_key"
    assert check(keys, second) == "verified" and check(restarted, second) == "verified"
    third = sign(keys)
    assert key_id(third) not in (key_id(first), key_id(second))
    assert stored(opener) == [(2, key_id(second)), (3, key_id(third))]  # the expired one: gone


def test_replicas_racing_make_one_key_between_them(opener: Callable[[], Any]) -> None:
    clock = Clock()
    assert stored(opener) == []  # the schema made (a SQLite file's), no key yet
    replicas = [ServerKeys(over(opener), PURPOSE, rotation=HOUR, clock=clock) for _ in range(6)]

    def race() -> set[str]:
        barrier = threading.Barrier(len(replicas))
        made: list[str] = []

        def one(keys: ServerKeys) -> None:
            barrier.wait()
            made.append(key_id(sign(keys)))

        threads = [threading.Thread(target=one, args=(k,)) for k in replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(made) == len(replicas)
        return set(made)

    [first] = race()
    clock.now += HOUR
    [second] = race()
    assert first != second
    assert stored(opener) == [(1, first), (2, second)]


def test_a_signature_is_bound_to_its_model_and_tenant(tmp_path: Path) -> None:
    keys = ServerKeys(over(lambda: KeyStore(tmp_path / "keys.db")), PURPOSE)
    signature = sign(keys, tenant="acme")
    assert check(keys, signature, tenant="acme") == "verified"
    assert check(keys, signature, tenant="globex") == "mismatch"
    assert check(keys, signature, model="another-model") == "mismatch"
    assert check(keys, signature, thought=THOUGHT + " (edited)") == "mismatch"
    # A key id this server never made (upper-casing the id, as before, left an all-digit
    # id as it was: the test failed about once in 44 runs).
    assert check(keys, "gone" + signature) == "unknown_key"
    assert check(keys, "EqRl4Wvh4hXvq9R8Zp0kYbQ2+/Anthropic=") == "unknown_key"  # another API's
    assert check(keys, key_id(signature) + ".\udcff") == "mismatch"  # not even ASCII

    lax = signer(keys, tenant="globex", signatures=(signature,))
    assert lax.verified(THOUGHT, signature, "messages.1.content.0") is False
    strict = signer(keys, tenant="globex", signatures=(signature,), strict=True)
    with pytest.raises(ApiError) as refused:
        strict.verified(THOUGHT, signature, "messages.1.content.0")
    assert refused.value.status == 400
    assert str(refused.value).startswith("messages.1.content.0.signature: invalid signature")


def test_an_unreadable_store_signs_with_a_key_of_its_own_then_catches_up(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    down = True

    def opener() -> KeyStore:
        if down:
            raise StoreUnavailable("the key store: connection refused")
        return KeyStore(path)

    clock = Clock()
    keys = ServerKeys(over(opener), PURPOSE, rotation=HOUR, clock=clock)
    own = sign(keys)
    assert check(keys, own) == "verified"
    unknown = "0badc0de.bWFj"
    strict = signer(keys, signatures=(unknown,), strict=True)
    with pytest.raises(ApiError) as refused:  # its key may exist: retry, not a 400
        strict.verified(THOUGHT, unknown, "messages.1.content.0")
    assert refused.value.status == 529 and "retry" in str(refused.value)

    down = False
    clock.now += RETRY_INTERVAL
    from_store = sign(keys)
    assert key_id(from_store) != key_id(own)
    assert stored(lambda: KeyStore(path)) == [(1, key_id(from_store))]
    assert check(keys, own) == "verified"  # for the overlap, on this process
    clock.now += HOUR + 1
    assert check(keys, own) == "unknown_key"
    with pytest.raises(ApiError) as refused:
        signer(keys, signatures=(unknown,), strict=True).verified(THOUGHT, unknown, "m")
    assert refused.value.status == 400


def test_an_operator_key_signs_on_every_replica_and_store_keys_still_verify(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.db"
    clock = Clock()
    before = sign(ServerKeys(over(lambda: KeyStore(path)), PURPOSE, rotation=HOUR, clock=clock))

    def replica(secret: bytes) -> ServerKeys:
        opened = lambda: KeyStore(path)  # noqa: E731
        return ServerKeys(over(opened), PURPOSE, rotation=HOUR, operator_secret=secret, clock=clock)

    one, two = replica(b"operator secret"), replica(b"operator secret")
    signature = sign(one)
    assert key_id(signature).startswith("op") and check(two, signature) == "verified"
    assert check(two, before) == "verified"
    assert check(replica(b"another secret"), signature) == "unknown_key"
    clock.now += 5 * HOUR  # the operator key never rotates, and no key is made in the store
    assert key_id(sign(one)) == key_id(signature)
    assert [g for g, _ in stored(lambda: KeyStore(path))] == [1]
    assert check(two, before) == "unknown_key"  # the store's last key expired meanwhile


def test_rotation_is_checked_where_it_enters() -> None:
    with pytest.raises(ValueError, match="signing key rotation"):
        ServerKeys(None, PURPOSE, rotation=1.0)
    done = subprocess.run(
        [sys.executable, "-m", "zerohop", "serve", "--signing-key-rotation", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and not done.stdout
    assert "--signing-key-rotation: must be a finite number >= 60, not '5'" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


# -- the prompt ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-template") / "qwen3"
    return with_chat_template(tiny_model("qwen3"), folder, QWEN3_THINKING_TEMPLATE)


def thinking(thought: str, signature: str) -> dict[str, str]:
    return {"type": "thinking", "thinking": thought, "signature": signature}


def tool_loop(block: dict[str, Any] | None, earlier: dict[str, Any] | None = None) -> list[dict]:
    """A conversation in a tool loop: an earlier exchange (its answer thought `earlier`), the
    question, a call (thought `block`) and its result."""
    call = {"type": "tool_use", "id": "toolu_01", "name": "weather", "input": {}}
    answer = [earlier] if earlier is not None else []
    result = {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"}
    return [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": [*answer, {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [block, call] if block is not None else [call]},
        {"role": "user", "content": [result]},
    ]


def prompt_text(ctx: ServingContext, messages: list[dict], who: ThoughtSigner) -> str:
    body = {"model": MODEL, "max_tokens": 64, "messages": messages, "tools": [TOOL]}
    request = decode_messages(msgspec.json.encode({**body, "thinking": ADAPTIVE}))
    conv = conversation(request, ctx.tokenizer.chat_template, signer=who)
    return ctx.tokenizer.decode(prompt_ids(conv, ctx), skip_special_tokens=False)


def test_the_tool_loops_verified_thought_is_rendered_as_qwen3_renders_it(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    ctx = ServingContext(None, Tokenizer.from_dir(qwen3_dir), MODEL, 4096)  # type: ignore[arg-type]
    keys = ServerKeys(over(lambda: KeyStore(tmp_path / "keys.db")), PURPOSE)
    signature = sign(keys)
    older = thinking("an earlier thought", sign(keys, thought="an earlier thought"))
    messages = tool_loop(thinking(THOUGHT, signature), earlier=older)
    text = prompt_text(ctx, messages, signer(keys, signatures=(signature,)))
    rendered = f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\n<tool_call>"
    assert rendered in text
    assert "an earlier thought" not in text  # before the last question: left out, as Qwen3 does
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")

    bare = prompt_text(ctx, tool_loop(None), signer(keys))
    assert "<think>\n" + THOUGHT not in bare
    for who, block in [
        (signer(keys, tenant="globex"), thinking(THOUGHT, signature)),  # another tenant's
        (signer(keys), thinking(THOUGHT + "!", signature)),  # edited
        (signer(keys), thinking(THOUGHT, "EqRl4Wvh4hXvq9R8Zp0k")),  # another deployment's
    ]:
        assert prompt_text(ctx, tool_loop(block), who) == bare  # left out
        strict = ThoughtSigner(who.keyring, who.model, who.tenant, strict=True, now=who.now)
        with pytest.raises(ApiError, match=r"messages\.3\.content\.0\.signature: invalid"):
            prompt_text(ctx, tool_loop(block), strict)


# -- live: a restart (SQLite) and replicas (PostgreSQL), through the anthropic SDK ---------------


def client(server: LiveServer, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def mint(server: LiveServer, key: str) -> dict[str, Any]:
    """A thinking block the server writes (greedy, the random model thinks all its tokens)."""
    message = client(server, key).messages.create(
        model=MODEL,
        max_tokens=16,
        thinking=ADAPTIVE,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[TOOL],
        extra_body={"temperature": 0.0},  # not a parameter of this SDK version any more
    )
    block = message.content[0]
    assert block.type == "thinking" and block.thinking.strip() and block.signature
    return block.model_dump(exclude_none=True)


def count(server: LiveServer, key: str, block: dict[str, Any] | None) -> int:
    kw: Any = {"model": MODEL, "messages": tool_loop(block), "tools": [TOOL], "thinking": ADAPTIVE}
    return client(server, key).messages.count_tokens(**kw).input_tokens


def continue_loop(server: LiveServer, key: str, block: dict[str, Any]) -> Any:
    return client(server, key).messages.create(
        model=MODEL, max_tokens=4, thinking=ADAPTIVE, messages=tool_loop(block), tools=[TOOL]
    )


def edited(block: dict[str, Any]) -> dict[str, Any]:
    return {**block, "thinking": block["thinking"] + " (edited)"}


def assert_rendered_only_when_verified(
    server: LiveServer, key: str, other: str, block: dict[str, Any]
) -> None:
    """On a lax server: the verified thought adds its tokens to the prompt; another tenant's
    key and an edited thought add none (left out, no error)."""
    bare = count(server, key, None)
    assert count(server, key, block) > bare
    assert count(server, other, block) == bare
    assert count(server, key, edited(block)) == bare


def assert_refused_unless_verified(
    server: LiveServer, key: str, other: str, block: dict[str, Any]
) -> None:
    """On a strict server: the verified thought continues the loop; another tenant's and an
    edited one are a 400 in the Anthropic error shape."""
    reply = continue_loop(server, key, block)
    assert reply.content[0].type == "thinking"
    for who, sent in ((other, block), (key, edited(block))):
        with pytest.raises(anthropic.BadRequestError, match="invalid signature") as refused:
            continue_loop(server, who, sent)
        error = refused.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("messages.3.content.0.signature: invalid signature")


def serve(
    model_dir: Path, folder: Path, *args: str, env: dict[str, str] | None = None
) -> LiveServer:
    """A server whose log and data (audit, ledger) are in `folder`, its own."""
    folder.mkdir(parents=True)
    server = LiveServer(model_dir, list(args), served_model_name=MODEL, extra_env=env or {})
    return server.start(folder / "server.log")


def test_a_thought_signed_before_a_restart_and_a_rotation_verifies_after_them(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    db = tmp_path / "keys.db"
    store = KeyStore(db)
    key_a, _ = store.create_key("acme")
    key_b, _ = store.create_key("globex")
    store.close()
    first = serve(qwen3_dir, tmp_path / "first", "--keys-db", str(db))
    try:
        block = mint(first, key_a)
        assert_rendered_only_when_verified(first, key_a, key_b, block)
        # Clearing the tool loop's thought frees the tokens it took in the prompt.
        keep = {"type": "thinking_turns", "value": 0}
        edits = {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}
        cleared = client(first, key_a).messages.create(
            model=MODEL,
            max_tokens=4,
            messages=tool_loop(block),
            tools=[TOOL],
            extra_body={"context_management": edits},
        )
        [applied] = cleared.model_dump()["context_management"]["applied_edits"]
        freed = count(first, key_a, block) - count(first, key_a, None)
        assert applied["cleared_input_tokens"] == freed > 0
    finally:
        first.stop()
    # The key is a rotation old (7 days and a minute) when the server comes back.
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE signing_keys SET created = created - (7 * 86400 + 60)")
    args = ("--keys-db", str(db), "--strict-thought-signatures")
    second = serve(qwen3_dir, tmp_path / "second", *args)
    try:
        assert count(second, key_a, block) > count(second, key_a, None)
        assert_refused_unless_verified(second, key_a, key_b, block)
        newer = mint(second, key_a)
        assert key_id(newer["signature"]) != key_id(block["signature"])  # rotated
    finally:
        second.stop()
    with sqlite3.connect(db) as conn:
        assert [g for (g,) in conn.execute("SELECT generation FROM signing_keys")] == [1, 2]


@pytest.fixture
def fleet(
    qwen3_dir: Path, postgres: Any, tmp_path: Path
) -> Iterator[tuple[list[LiveServer], str, str]]:
    from tests.pg_fixtures import migrated_database
    from zerohop.gateway.store.postgres import PostgresStore

    url = migrated_database(postgres)
    store = PostgresStore(url)
    key_a, _ = store.create_key("acme")
    key_b, _ = store.create_key("globex")
    store.close()
    env = {"ZEROHOP_STORE": url}
    servers = []
    try:
        servers.append(serve(qwen3_dir, tmp_path / "lax", env=env))
        strict = "--strict-thought-signatures"
        servers.append(serve(qwen3_dir, tmp_path / "strict", strict, env=env))
        yield servers, key_a, key_b
    finally:
        for server in servers:
            server.stop()


def test_a_thought_signed_on_one_replica_verifies_on_another(
    fleet: tuple[list[LiveServer], str, str],
) -> None:
    (lax, strict), key_a, key_b = fleet
    block = mint(lax, key_a)
    assert_refused_unless_verified(strict, key_a, key_b, block)
    back = mint(strict, key_a)
    assert key_id(back["signature"]) == key_id(block["signature"])  # one key for the fleet
    assert_rendered_only_when_verified(lax, key_a, key_b, back)


def test_a_postgresql_store_at_version_4_is_migrated_to_have_the_table(postgres: Any) -> None:
    from tests.pg_fixtures import fresh_database, sql
    from zerohop.gateway.store.pg_migrations import _apply, migrate
    from zerohop.gateway.store.pg_schema import MIN_READER, PG_MIGRATIONS
    from zerohop.gateway.store.postgres import PostgresStore, connect

    versions = [v for v, _ in PG_MIGRATIONS]
    assert versions == sorted(versions) and 5 in versions and MIN_READER[5] == 2
    url = fresh_database(postgres)
    with connect(url) as conn:  # the store as a zerohop of version 4 left it
        for version, step in PG_MIGRATIONS[: versions.index(5)]:
            assert _apply(conn, version, step)
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
    assert "signing_keys" not in {r[0] for r in sql(url, tables)}
    assert 5 in migrate(url).applied
    assert "signing_keys" in {r[0] for r in sql(url, tables)}
    assert sql(url, "SELECT version, min_reader FROM zerohop_schema WHERE version = 5") == [(5, 2)]
    keys = ServerKeys(over(lambda: PostgresStore(url)), PURPOSE)
    assert check(keys, sign(keys)) == "verified"
