"""The stored-responses table (zerohop.gateway.store.response_tables) in both stores, SQLite and
a real PostgreSQL: a round trip, a background response written again by its tenant, another
tenant's id invisible and never overwritten, expiry and the purge on put, delete, a status
changed only while unfinished, bad statuses refused; and a PostgreSQL store at schema version
3 migrated to version 4, which has the table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zerohop.gateway.store.response_tables import STATUSES, ResponseRow, StoredResponse
from zerohop.gateway.store.sqlite import KeyStore

BODY = '{"id": "resp_1", "status": "completed", "output": []}'
ITEMS = '[{"type": "message", "role": "user", "content": "hi"}]'


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


def raw(store: Any, where: str = "") -> list[tuple[Any, ...]]:
    """The table's rows as stored, whichever store: (id, tenant, status, bytes, created,
    expires), by id."""
    query = f"SELECT response_id, tenant, status, bytes, created, expires FROM responses {where}"
    query += " ORDER BY response_id"
    if isinstance(store, KeyStore):
        return [tuple(r) for r in store.conn.execute(query)]
    from tests.pg_fixtures import sql

    return sql(store.url, query)


def response(
    response_id: str = "resp_1",
    tenant: str = "acme",
    status: str = "completed",
    body: str = BODY,
    items: str = ITEMS,
    expires: float = 1000.0,
) -> ResponseRow:
    return ResponseRow(response_id, tenant, status, body, items, expires)


def test_a_stored_response_reads_back_as_written(store: Any) -> None:
    store.put_response(response(), 100.0)
    assert store.get_response("acme", "resp_1", 101.0) == StoredResponse("completed", BODY, ITEMS)
    assert store.get_response("acme", "resp_unknown", 101.0) is None
    assert raw(store) == [("resp_1", "acme", "completed", len(BODY) + len(ITEMS), 100.0, 1000.0)]


def test_its_tenant_writes_it_again_and_keeps_its_creation_time(store: Any) -> None:
    store.put_response(response(status="in_progress", body="{}", items="[]"), 100.0)
    assert store.get_response("acme", "resp_1", 101.0) == StoredResponse("in_progress", "{}", "[]")
    store.put_response(response(expires=2000.0), 110.0)  # the background response ended
    assert store.get_response("acme", "resp_1", 1500.0) == StoredResponse("completed", BODY, ITEMS)
    assert raw(store) == [("resp_1", "acme", "completed", len(BODY) + len(ITEMS), 100.0, 2000.0)]


def test_another_tenants_id_is_invisible_and_never_overwritten(store: Any) -> None:
    store.put_response(response(), 100.0)
    assert store.get_response("other", "resp_1", 101.0) is None
    assert store.delete_response("other", "resp_1", 101.0) is False
    assert store.set_response_status("other", "resp_1", "cancelled", None, 101.0) is False
    with pytest.raises(ValueError, match="another tenant's"):
        store.put_response(response(tenant="other", status="failed", body="{}"), 102.0)
    assert store.get_response("acme", "resp_1", 103.0) == StoredResponse("completed", BODY, ITEMS)
    assert raw(store) == [("resp_1", "acme", "completed", len(BODY) + len(ITEMS), 100.0, 1000.0)]


def test_an_expired_response_is_gone_and_a_put_purges_it(store: Any) -> None:
    store.put_response(response("resp_old", expires=200.0), 100.0)
    store.put_response(response("resp_new", expires=900.0), 100.0)
    assert store.get_response("acme", "resp_old", 200.0) is not None  # until its expiry
    assert store.get_response("acme", "resp_old", 200.5) is None
    assert store.delete_response("acme", "resp_old", 201.0) is False
    assert store.set_response_status("acme", "resp_old", "cancelled", None, 201.0) is False
    assert [r[0] for r in raw(store)] == ["resp_new", "resp_old"]  # still there: no put yet
    store.put_response(response("resp_other", tenant="other", expires=900.0), 201.0)
    assert [r[0] for r in raw(store)] == ["resp_new", "resp_other"]
    # An expired id of one tenant may be taken by another (the put purges it first).
    store.put_response(response("resp_x", expires=300.0), 250.0)
    store.put_response(response("resp_x", tenant="other", status="failed"), 301.0)
    assert store.get_response("other", "resp_x", 302.0) == StoredResponse("failed", BODY, ITEMS)
    assert store.get_response("acme", "resp_x", 302.0) is None


def test_a_deleted_response_is_gone(store: Any) -> None:
    store.put_response(response(), 100.0)
    store.put_response(response("resp_2"), 100.0)
    assert store.delete_response("acme", "resp_1", 101.0) is True
    assert store.get_response("acme", "resp_1", 101.0) is None
    assert store.delete_response("acme", "resp_1", 102.0) is False
    assert [r[0] for r in raw(store)] == ["resp_2"]
    store.put_response(response(tenant="other"), 103.0)  # the id is free again
    assert store.get_response("other", "resp_1", 104.0) == StoredResponse("completed", BODY, ITEMS)


def test_the_status_changes_only_while_the_response_is_unfinished(store: Any) -> None:
    store.put_response(response(status="queued", body="{}", items="[]"), 100.0)
    assert store.set_response_status("acme", "resp_1", "in_progress", None, 101.0) is True
    assert store.get_response("acme", "resp_1", 101.0) == StoredResponse("in_progress", "{}", "[]")
    cancelled = '{"id": "resp_1", "status": "cancelled"}'
    assert store.set_response_status("acme", "resp_1", "cancelled", cancelled, 102.0) is True
    assert store.get_response("acme", "resp_1", 102.0) == StoredResponse(
        "cancelled", cancelled, "[]"
    )
    assert raw(store)[0][3] == len(cancelled) + len("[]")
    assert store.set_response_status("acme", "resp_1", "cancelled", "{}", 103.0) is False
    assert store.set_response_status("acme", "resp_1", "in_progress", None, 103.0) is False
    assert store.get_response("acme", "resp_1", 103.0) == StoredResponse(
        "cancelled", cancelled, "[]"
    )
    for finished in ("completed", "incomplete", "failed"):
        store.put_response(response(f"resp_{finished}", status=finished), 104.0)
        assert not store.set_response_status("acme", f"resp_{finished}", "cancelled", "{}", 105.0)
        got = store.get_response("acme", f"resp_{finished}", 105.0)
        assert got == StoredResponse(finished, BODY, ITEMS)
    assert store.set_response_status("acme", "resp_unknown", "cancelled", None, 105.0) is False


def test_a_status_outside_the_six_is_refused(store: Any) -> None:
    assert len(STATUSES) == 6
    with pytest.raises(ValueError, match="'done' is not one of"):
        store.put_response(response(status="done"), 100.0)
    assert raw(store) == []
    store.put_response(response(status="in_progress"), 100.0)
    with pytest.raises(ValueError, match="'done' is not one of"):
        store.set_response_status("acme", "resp_1", "done", None, 101.0)
    assert store.get_response("acme", "resp_1", 101.0) == StoredResponse("in_progress", BODY, ITEMS)


def test_a_sqlite_file_made_before_the_table_gets_it_on_open(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    KeyStore(path).close()
    old = KeyStore(path)
    old.conn.execute("DROP TABLE responses")
    old.close()
    reopened = KeyStore(path)
    reopened.put_response(response(), 100.0)
    assert reopened.get_response("acme", "resp_1", 101.0) == StoredResponse(
        "completed", BODY, ITEMS
    )
    reopened.close()


def test_a_postgresql_store_at_version_3_is_migrated_to_have_the_table(postgres: Any) -> None:
    from tests.pg_fixtures import fresh_database, sql
    from zerohop.gateway.store.open_store import SchemaMismatch
    from zerohop.gateway.store.pg_migrations import Migrated, _apply, migrate
    from zerohop.gateway.store.pg_schema import MIN_READER, PG_MIGRATIONS, SCHEMA_VERSION
    from zerohop.gateway.store.postgres import PostgresStore, connect

    assert PG_MIGRATIONS[3][0] == 4 and MIN_READER[4] == 2
    later = [version for version, _ in PG_MIGRATIONS[3:]]
    url = fresh_database(postgres)
    with connect(url) as conn:  # the store as the previous zerohop left it
        for version, step in PG_MIGRATIONS[:3]:
            assert _apply(conn, version, step)
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
    assert "message_threads" in {r[0] for r in sql(url, tables)}
    assert "responses" not in {r[0] for r in sql(url, tables)}
    needs = f"has schema version 3 and this zerohop needs {SCHEMA_VERSION}"
    with pytest.raises(SchemaMismatch, match=needs):
        PostgresStore(url)
    assert migrate(url) == Migrated(later, SCHEMA_VERSION)
    assert "responses" in {r[0] for r in sql(url, tables)}
    indexes = sql(url, "SELECT indexname FROM pg_indexes WHERE tablename = 'responses'")
    assert {"responses_pkey", "responses_expires"} <= {r[0] for r in indexes}
    assert sql(url, "SELECT version, min_reader FROM zerohop_schema WHERE version = 4") == [(4, 2)]
    store = PostgresStore(url)
    store.put_response(response(), 100.0)
    assert store.get_response("acme", "resp_1", 101.0) == StoredResponse("completed", BODY, ITEMS)
    store.close()
    assert migrate(url) == Migrated([], SCHEMA_VERSION)
