"""A fleet replica starts while PostgreSQL is down (zerohop.gateway.store.key_snapshot): a real
`zerohop serve` on a real PostgreSQL serves once (its local snapshot is written, 0600, secret
hashes only), is stopped, PostgreSQL is stopped, and the replica starts again from its
snapshot: a known key is served (the official SDK as the client), an unknown one refused, a
budgeted one refused as retryable (no lease can be had), /ready is 200 and says so, as does
/metrics. Once PostgreSQL is back the replica catches up: a key revoked while it was away
stops working. Without a snapshot, or with one older than --store-snapshot-max-age, or of
another store, the start fails in one line."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.pg_fixtures import migrated_database, wait_until
from tests.postgres_server import PostgresServer
from zerohop.cli import main
from zerohop.gateway.keys.identity import Budget, Tenant
from zerohop.gateway.store.key_snapshot import FILE_NAME, LocalCopy, SnapshotUnusable
from zerohop.gateway.store.postgres import PostgresStore
from zerohop.gateway.store.rows import KeyRows
from zerohop.gateway.store.spec import STORE_ENV, mask_password
from zerohop.gateway.store.sqlite import hash_secret

DAY = 24 * 3600.0


def _say_hi(server: LiveServer, key: str) -> anthropic.types.Message:
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)
    return client.messages.create(
        model=MODEL_NAME,
        max_tokens=4,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"temperature": 0},
    )


def _status(server: LiveServer, key: str) -> int:
    try:
        _say_hi(server, key)
    except anthropic.APIStatusError as exc:
        return exc.status_code
    return 200


def _metrics(server: LiveServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _ready(server: LiveServer) -> httpx.Response:
    return httpx.get(server.url + "/ready", timeout=10)


def _serve(model: Path, keys_db: Path, *extra: str) -> list[str]:
    return ["serve", str(model), "--port", "0", "--keys-db", str(keys_db), *extra]


def test_a_replica_starts_from_its_snapshot_while_postgres_is_down(
    llama_dir: Path,
    postgres: PostgresServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = migrated_database(postgres)
    store = PostgresStore(url)
    known, _ = store.create_key("snap")
    revoked, revoked_record = store.create_key("snap")
    store.upsert_tenant(Tenant("snap-budget", budget=Budget(1_000_000, "total")))
    budgeted, _ = store.create_key("snap-budget")
    keys_db = tmp_path / "replica" / "replica.db"
    replica = LiveServer(llama_dir, ["--keys-db", str(keys_db)], extra_env={STORE_ENV: url})
    replica.start(tmp_path / "first.log")
    try:
        assert _status(replica, known) == 200
        assert _status(replica, budgeted) == 200  # served by a lease while PostgreSQL is up
    finally:
        replica.stop()
    snapshot = keys_db.parent / FILE_NAME
    assert stat.S_IMODE(snapshot.stat().st_mode) == 0o600
    text = snapshot.read_text()
    assert hash_secret(known) in text and known not in text  # hashes, never secrets
    assert [p.name for p in snapshot.parent.iterdir() if p.name.endswith(".tmp")] == []
    first_read_at = json.loads(text)["read_at"]

    assert store.revoke_key(revoked_record.key_id)  # while the replica is away
    store.close()
    monkeypatch.setenv(STORE_ENV, url)
    postgres.stop()
    try:
        _refused_without_a_usable_snapshot(llama_dir, tmp_path, snapshot, capsys)
        replica.start(tmp_path / "second.log")
        assert "serving the 3 keys of the local snapshot" in replica.log()
        message = _say_hi(replica, known)
        assert message.content[0].type == "text" and message.usage.output_tokens > 0
        # The snapshot is what the replica last read: the key revoked since still works.
        assert _status(replica, revoked) == 200
        unknown = openai.OpenAI(base_url=replica.url + "/v1", api_key="zh-unknown", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            unknown.chat.completions.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        assert _status(replica, budgeted) == 529  # no lease to spend: retryable, not admitted
        ready = _ready(replica)
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ok" and body["keys"] == "snapshot"
        assert body["snapshot_age_seconds"] >= 0
        metrics = _metrics(replica)
        assert "zerohop_store_snapshot_serving 1.0" in metrics
        assert "zerohop_store_up 0.0" in metrics
        assert "zerohop_store_snapshot_age_seconds " in metrics
    finally:
        postgres.start()

    try:
        # Caught up: the revocation made while the replica was away now holds there too.
        wait_until(lambda: _status(replica, revoked) == 401, 60.0, 0.2)
        assert _status(replica, known) == 200
        assert _ready(replica).json() == {"status": "ok"}
        assert "zerohop_store_snapshot_serving 0.0" in _metrics(replica)
        wait_until(lambda: _status(replica, budgeted) == 200, 30.0, 0.2)  # leases again
        assert json.loads(snapshot.read_text())["read_at"] > first_read_at  # refreshed
    finally:
        replica.stop()


def _refused_without_a_usable_snapshot(
    llama_dir: Path, tmp_path: Path, snapshot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With PostgreSQL down, a start without a snapshot, or with one past its age, fails in
    one line, before the model loads."""
    capsys.readouterr()
    assert main(_serve(llama_dir, tmp_path / "elsewhere" / "replica.db")) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("zerohop: the key store postgresql://"), line
    assert "no local snapshot of its keys to start from" in line
    assert f"{tmp_path / 'elsewhere' / FILE_NAME} does not exist" in line

    old = tmp_path / "old" / FILE_NAME
    old.parent.mkdir()
    document = json.loads(snapshot.read_text())
    document["read_at"] -= DAY + 60
    old.write_text(json.dumps(document))
    assert main(_serve(llama_dir, tmp_path / "old.db", "--store-snapshot", str(old))) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "past --store-snapshot-max-age (24.0 h)" in line, line
    # The same file is young enough for a longer maximum: the refusal was its age alone.
    assert LocalCopy(old, document["store"], 2 * DAY).load().has_keys


def test_the_snapshot_flags_are_validated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags, words in [
        (["--store-snapshot-max-age", "0"], "--store-snapshot-max-age"),
        (["--store-snapshot-max-age", "a day"], "--store-snapshot-max-age"),
        (["--store-snapshot", str(tmp_path)], "is a folder: name a file in it"),
        (["--store-snapshot", ""], "an empty path"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(_serve(tmp_path, tmp_path / "keys.db", *flags))
        assert exited.value.code == 2
        assert words in capsys.readouterr().err


def _rows() -> KeyRows:
    tenant = {"name": "t", "weight": 1.0, "rpm": None, "itpm": None, "otpm": None}
    tenant |= {"max_concurrency": None, "budget_tokens": None, "budget_period": None}
    key = {k: v for k, v in tenant.items() if k not in ("name", "weight")}
    key |= {"key_id": "zh-abcdefgh", "secret_sha256": "ab" * 32, "tenant": "t", "name": ""}
    key |= {"created": 1.0, "expires": None, "revoked": None, "models": "[]"}
    key |= {"priority": "interactive", "admin": 0, "inference": 1, "archived": None}
    key |= {"created_by": None}
    return KeyRows(7, [tenant], [key])


def test_the_snapshot_file_is_replaced_whole_and_kept_private(tmp_path: Path) -> None:
    path = tmp_path / "state" / FILE_NAME
    path.parent.mkdir()
    path.write_text("left by someone else")
    os.chmod(path, 0o644)
    store = mask_password("postgresql://zerohop:s3cret@db/zerohop")
    local = LocalCopy(path, store, DAY)
    now = time.time()
    local.save(_rows(), now - 5)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == [FILE_NAME]
    assert "s3cret" not in path.read_text()
    assert not local.serving and local.age(now) == pytest.approx(5)
    loaded = LocalCopy(path, store, DAY).load(now)
    assert loaded.version == 7 and list(loaded.index()) == ["ab" * 32]

    with pytest.raises(SnapshotUnusable, match="is of another store"):
        LocalCopy(path, mask_password("postgresql://zerohop@other/zerohop"), DAY).load(now)
    with pytest.raises(SnapshotUnusable, match="past --store-snapshot-max-age"):
        LocalCopy(path, store, 4.0).load(now)
    path.write_text('{"format": 1, "store": "x"')
    with pytest.raises(SnapshotUnusable, match="is not JSON"):
        LocalCopy(path, store, DAY).load(now)
    path.write_text(json.dumps({"format": 1, "store": store, "read_at": now, "version": 1}))
    with pytest.raises(SnapshotUnusable, match="is not a valid snapshot"):
        LocalCopy(path, store, DAY).load(now)


def test_an_unwritable_snapshot_is_counted_and_serving_goes_on(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    local = LocalCopy(blocked / FILE_NAME, "postgresql://db/zerohop", DAY)
    local.save(_rows(), time.time())  # its folder cannot be made: logged, counted, not raised
    assert local.write_errors == 1 and local.age() is None
