"""zerohop.gateway.usage: requests' tokens and refusals, added up per minute in memory and
written to a real SQLite key store; kept and retried while the store cannot be opened."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerohop.gateway.gateway import Call
from zerohop.gateway.keys.identity import Identity, Tenant
from zerohop.gateway.store.sqlite import KeyStore
from zerohop.gateway.store.store import Store
from zerohop.gateway.store.usage_tables import UsageRow
from zerohop.gateway.usage import UsageRecorder

MINUTE = 1_700_000_040  # a minute's start


def call(key: str, tenant: str, **fields) -> Call:
    done = Call("req_1", "anthropic", identity=Identity(key, Tenant(tenant)), model="m")
    for name, value in fields.items():
        setattr(done, name, value)
    return done


def served(key: str = "zh-a", tenant: str = "t", status: int = 200) -> Call:
    return call(key, tenant, decision="admitted", prompt_tokens=10, cached_tokens=4,
                output_tokens=6, status=status)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = MINUTE + 1.0

    def __call__(self) -> float:
        return self.now


def test_requests_are_summed_per_minute_and_refusals_keep_their_message(tmp_path: Path):
    clock = Clock()
    store = KeyStore(tmp_path / "keys.db")
    recorder = UsageRecorder(Store(lambda: KeyStore(tmp_path / "keys.db")).usage, clock=clock)
    recorder.record(served())
    recorder.record(served(status=500))
    recorder.record(call("zh-a", "t", decision="admitted", prompt_tokens=0))  # never served
    recorder.record(call("zh-b", "u", decision="rate_limit_requests", refusal="rpm of 0"))
    clock.now += 60
    recorder.record(served())
    assert recorder.flush()
    assert store.usage(60, MINUTE, MINUTE + 120) == [
        UsageRow(MINUTE, "zh-a", "t", "m", 2, 1, 12, 8, 12),
        UsageRow(MINUTE + 60, "zh-a", "t", "m", 1, 0, 6, 4, 6),
    ]
    (refusal,) = store.refusals(MINUTE, MINUTE + 120)
    assert (refusal.key_id, refusal.reason, refusal.count) == ("zh-b", "rate_limit_requests", 1)
    assert refusal.last_message == "rpm of 0"
    recorder.record(served())
    recorder.close()  # the last rows are written on close
    assert store.usage(3600, MINUTE - MINUTE % 3600, MINUTE + 3600)[0].requests == 4


def test_rows_are_kept_while_the_store_cannot_be_opened(tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's folder should be")
    target = {"path": blocker / "keys.db"}
    recorder = UsageRecorder(Store(lambda: KeyStore(target["path"])).usage, clock=Clock())
    recorder.record(served())
    assert not recorder.flush() and recorder.failures == 1
    recorder.record(served())
    assert not recorder.flush()
    target["path"] = tmp_path / "keys.db"  # the store comes back
    assert recorder.flush()
    rows = KeyStore(target["path"]).usage(60, MINUTE, MINUTE + 60)
    assert [r.requests for r in rows] == [2]  # each once, nothing lost or doubled
    assert recorder.flush()  # nothing left to write


def test_past_max_rows_the_oldest_minutes_are_dropped_and_counted(tmp_path: Path):
    clock = Clock()
    recorder = UsageRecorder(
        Store(lambda: KeyStore(tmp_path / "f" / "x.db")).usage, max_rows=2, clock=clock
    )
    (tmp_path / "f").write_text("blocks the store")
    for _ in range(3):
        recorder.record(served())
        clock.now += 60
    assert not recorder.flush()
    assert recorder.dropped == 1
    (tmp_path / "f").unlink()
    assert recorder.flush()
    rows = KeyStore(tmp_path / "f" / "x.db").usage(60, MINUTE, MINUTE + 600)
    assert [r.minute for r in rows] == [MINUTE + 60, MINUTE + 120]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        UsageRecorder(Store.in_memory().usage, interval=0)
    with pytest.raises(ValueError):
        UsageRecorder(Store.in_memory().usage, max_rows=0)
