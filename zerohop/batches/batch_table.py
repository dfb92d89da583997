"""Batches: created whole with their lines, read, paged, cancelled, expired, ended, deleted."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from zerohop.batches.file_table import FileTable
from zerohop.batches.line_table import LineTable, _line_rows
from zerohop.batches.records import (
    CANCELED,
    CANCELING,
    ENDED,
    EXPIRED,
    FAILED,
    IN_PROGRESS,
    OPEN,
    RUNNING,
    WAITING,
    Api,
    BatchNotEnded,
    BatchRecord,
    NewBatch,
    NewFile,
    NewLine,
    Page,
)
from zerohop.batches.schema import (
    _BATCH_COLUMNS,
    Statements,
    _batch,
    _dumps,
    _owned,
    new_batch_id,
    new_file_id,
)


class BatchTable(LineTable, FileTable):
    def create_batch(self, new: NewBatch, lines: Iterable[NewLine]) -> BatchRecord:
        """The batch and every line, in one transaction; DuplicateCustomId refuses it whole."""
        batch_id = new_batch_id(new.api)
        now = time.time() if new.created_at is None else new.created_at
        failed = bool(new.errors)
        values = (
            batch_id, new.tenant, new.key_id, new.api, new.endpoint, new.model,
            FAILED if failed else IN_PROGRESS, now, now + new.expires_in, now if failed else None,
            None, None, None, new.completion_window, new.input_file_id, None, None,
            _dumps(new.metadata), _dumps(new.errors), None, _dumps(new.identity),
        )  # fmt: skip
        with self._transaction() as conn:
            conn.execute(
                f"INSERT INTO batches ({_BATCH_COLUMNS}) VALUES ({','.join('?' * len(values))})",
                values,
            )
            conn.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, params, state, result, finished_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                _line_rows(batch_id, lines, now),
            )
        record = self.batch(None, batch_id)
        assert record is not None
        return record

    def batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        with self._lock:
            row = self.conn.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
        return None if row is None or not _owned(row, tenant) else _batch(row)

    def list_batches(
        self,
        tenant: str,
        api: Api,
        *,
        limit: int = 20,
        after_id: str | None = None,
        before_id: str | None = None,
    ) -> Page:
        """Newest first. `after_id`: the page older than that batch; `before_id`: the page
        newer than it (still newest first), as Anthropic's list pages (OpenAI's `after`
        is `after_id`)."""
        where, args = "tenant = ? AND api = ?", list[str | int]([tenant, api])
        direction = "DESC"
        if before_id is not None:
            where += " AND seq > ?"
            args.append(self._cursor("batches", tenant, before_id))
            direction = "ASC"
        elif after_id is not None:
            where += " AND seq < ?"
            args.append(self._cursor("batches", tenant, after_id))
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE {where} ORDER BY seq {direction} LIMIT ?"
        with self._lock:
            rows = self.conn.execute(sql, (*args, limit + 1)).fetchall()
        batches = [_batch(r) for r in rows[:limit]]
        if direction == "ASC":
            batches.reverse()
        return Page(batches, len(rows) > limit)

    def recent_batches(self, limit: int, tenant: str | None = None) -> list[BatchRecord]:
        """The newest `limit` batches of every API and tenant (or of one): the admin API's."""
        where, args = ("WHERE tenant = ?", [tenant]) if tenant is not None else ("", [])
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches {where} ORDER BY seq DESC LIMIT ?"
        with self._lock:
            rows = self.conn.execute(sql, (*args, limit)).fetchall()
        return [_batch(r) for r in rows]

    def cancel_batch(
        self, tenant: str | None, batch_id: str, now: float | None = None
    ) -> BatchRecord | None:
        """Start cancelling an open batch: its waiting lines are canceled at once; running
        ones finish (or are aborted) and are recorded as usual. An ended batch is unchanged."""
        record = self.batch(tenant, batch_id)
        if record is None:
            return None
        if record.status == IN_PROGRESS:
            now = time.time() if now is None else now
            with self._transaction() as conn:
                conn.execute(
                    "UPDATE batches SET status = ?, cancel_initiated_at = ?"
                    " WHERE id = ? AND status = ?",
                    (CANCELING, now, batch_id, IN_PROGRESS),
                )
                self._finish_waiting(conn, batch_id, CANCELED, now)
        return self.batch(tenant, batch_id)

    def expire_due(self, now: float | None = None) -> list[str]:
        """Open batches past their expiry: waiting lines become expired. Their ids."""
        now = time.time() if now is None else now
        with self._transaction() as conn:
            due = [
                r[0]
                for r in conn.execute(
                    "SELECT id FROM batches WHERE status IN (?, ?) AND expires_at <= ?"
                    " AND expired_at IS NULL",
                    (*OPEN, now),
                )
            ]
            for batch_id in due:
                conn.execute("UPDATE batches SET expired_at = ? WHERE id = ?", (now, batch_id))
                self._finish_waiting(conn, batch_id, EXPIRED, now)
        return due

    def open_batches(self) -> list[BatchRecord]:
        """Batches whose lines may still run or that wait to be finalized, oldest first."""
        with self._lock:
            rows = self.conn.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN (?, ?) ORDER BY seq", OPEN
            ).fetchall()
        return [_batch(r) for r in rows]

    def finish_batch(
        self,
        batch_id: str,
        *,
        output: NewFile | None = None,
        error: NewFile | None = None,
        usage: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> BatchRecord | None:
        """End a batch none of whose lines is waiting or running, with its output and error
        files (written first, committed with the batch's end). None: not open, or lines open."""
        record = self.batch(None, batch_id)
        if record is None or not record.open or self.counts(batch_id).processing:
            return None
        written = {
            name: (new_file_id(), new)
            for name, new in (("output", output), ("error", error))
            if new is not None
        }
        for file_id, new in written.values():
            self._write_content(file_id, new.content)
        ended = False
        try:
            ended = self._end(record, written, usage, time.time() if now is None else now)
        finally:
            if not ended:
                for file_id, _ in written.values():
                    self._remove_content(file_id)
        return self.batch(None, batch_id) if ended else None

    def _end(
        self,
        record: BatchRecord,
        written: dict[str, tuple[str, NewFile]],
        usage: dict[str, Any] | None,
        now: float,
    ) -> bool:
        ids = {name: file_id for name, (file_id, _) in written.items()}
        with self._transaction() as conn:
            open_lines = conn.execute(
                "SELECT 1 FROM lines WHERE batch_id = ? AND state IN (?, ?) LIMIT 1",
                (record.id, WAITING, RUNNING),
            ).fetchone()
            if open_lines is not None:
                return False
            done = conn.execute(
                "UPDATE batches SET status = ?, ended_at = ?, output_file_id = ?,"
                " error_file_id = ?, usage = ? WHERE id = ? AND status IN (?, ?)",
                (ENDED, now, ids.get("output"), ids.get("error"), _dumps(usage), record.id, *OPEN),
            )
            if done.rowcount != 1:
                return False
            for file_id, new in written.values():
                self._insert_file(conn, file_id, record.tenant, new)
        return True

    def delete_batch(self, tenant: str | None, batch_id: str) -> bool:
        """Delete an ended batch, its lines and its output files; BatchNotEnded if it is open."""
        record = self.batch(tenant, batch_id)
        if record is None:
            return False
        if record.open:
            raise BatchNotEnded(f"batch {batch_id} is still processing; cancel it first")
        outputs = [i for i in (record.output_file_id, record.error_file_id) if i is not None]
        with self._transaction() as conn:
            conn.execute("DELETE FROM batches WHERE id = ?", (batch_id,))
            for file_id in outputs:
                conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        for file_id in outputs:
            self._remove_content(file_id)
        return True

    def _finish_waiting(self, conn: Statements, batch_id: str, state: str, now: float) -> None:
        conn.execute(
            "UPDATE lines SET state = ?, finished_at = ? WHERE batch_id = ? AND state = ?",
            (state, now, batch_id, WAITING),
        )
