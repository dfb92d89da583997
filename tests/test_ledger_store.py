"""The budget ledger writes through the process's one store: its writer's tables are opened
by the store's `LedgerRepository` on the store's SQLite file, so the spend a restarted ledger
starts from and the spend the reports read (`store.ledger.spend()`) are the writer's commits.
Real SQLite files, no mocks."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from zerohop.gateway.budgets.sqlite_ledger import BudgetLedger
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.keys.identity import Budget, Identity, Tenant
from zerohop.gateway.store.ledger_tables import Reserve, Settle
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

BUDGETED = Identity("zh-lstore01", Tenant("t-lstore", budget=Budget(5000)), budget=Budget(1000))
KEY_TOTAL = (f"key:{BUDGETED.key_id}", "total")
TENANT_TOTAL = (f"tenant:{BUDGETED.tenant.name}", "total")


def _rows(store: Store) -> dict[tuple[str, str], int]:
    return {(subject, period): tokens for subject, period, tokens in store.ledger.spend()}


def test_the_gateways_ledger_writes_its_stores_file_and_the_reports_see_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "keys.db"

    async def run() -> None:
        gateway = Gateway.from_store(StoreSpec.sqlite(db), local_db=db)  # as `serve` builds it
        ledger = gateway.ledger
        assert isinstance(ledger, BudgetLedger)
        assert ledger.writer.ledger is gateway.store.ledger
        gateway.start()
        reservation = ledger.reserve(BUDGETED, "req_seen", 10, 100)
        assert reservation is not None
        await ledger.confirm(reservation)
        # The reports read the store's shared connection: the writer's commit is there.
        seen = await asyncio.to_thread(_rows, gateway.store)
        assert seen[KEY_TOTAL] == seen[TENANT_TOTAL] == 110
        await gateway.close()

    asyncio.run(run())
    store = Store.of(StoreSpec.sqlite(db))
    restarted = BudgetLedger(store.ledger)  # the durable spend, read from the store's file
    restarted.start()
    try:
        assert restarted.spent[KEY_TOTAL] == 110
    finally:
        restarted.close()
        store.close()


def test_the_tables_keep_the_ledgers_semantics(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    tables = store.ledger.writer("normal")
    charges = [("key:k", "total", 100), ("tenant:t", "total", 100)]
    try:
        assert tables.synchronous == 1
        tables.commit([Reserve("req_1", charges), Reserve("req_1", charges)])
        tables.commit([Settle("req_1", charges, 30), Settle("req_1", charges, 0)])
        tables.commit([Settle("req_never", charges, 0)])
        tables.probe()
        assert tables.spend() == {("key:k", "total"): 130, ("tenant:t", "total"): 130}
        tables.commit([Reserve("req_cut", charges)])  # a crash: never settled
        tables.forget_reservations()
        tables.commit([Settle("req_cut", charges, 0)])  # nothing left to refund
        expected = {("key:k", "total"): 230, ("tenant:t", "total"): 230}
        assert tables.spend() == _rows(store) == expected
    finally:
        tables.close()
        store.close()


def test_a_failed_transaction_is_rolled_back_whole(tmp_path: Path) -> None:
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    tables = store.ledger.writer("full")
    unwritable: list[tuple[str, str, int]] = [(None, "total", 5)]  # type: ignore[list-item]
    try:
        with pytest.raises(sqlite3.IntegrityError, match="NOT NULL"):
            tables.commit([Reserve("req_ok", [("key:k", "total", 5)]), Reserve("x", unwritable)])
        assert tables.spend() == {}
        tables.commit([Reserve("req_ok", [("key:k", "total", 5)])])  # not left in a transaction
        assert tables.spend() == {("key:k", "total"): 5}
    finally:
        tables.close()
        store.close()


@pytest.mark.parametrize(
    "spec", [StoreSpec.parse("postgresql://zerohop@127.0.0.1:9/zerohop"), None], ids=["pg", "mem"]
)
def test_a_store_without_a_file_of_its_own_has_no_ledger_writer(spec: StoreSpec | None) -> None:
    store = Store.of(spec) if spec is not None else Store.in_memory()
    ledger = BudgetLedger(store.ledger)  # constructing opens nothing
    with pytest.raises(ValueError, match="budget ledger"):
        ledger.start()
    store.close()
