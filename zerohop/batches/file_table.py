"""Files: rows in `files`; contents on disk beside the database, one file per id (the
PostgreSQL store keeps them in the database instead: zerohop.batches.pg_store).

A content is written (and fsynced) under a temporary name and renamed before its row is
committed; contents without a row (a crash in between) are swept when the store opens.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Literal

from zerohop.batches.records import FileRecord, NewFile, Page
from zerohop.batches.schema import (
    _FILE_COLUMNS,
    _FILE_FIELDS,
    Connection,
    Statements,
    _owned,
    new_file_id,
)


class FileTable(Connection):
    files_dir: Path

    def put_file(
        self,
        tenant: str,
        purpose: str,
        filename: str,
        content: bytes,
        *,
        expires_at: float | None = None,
    ) -> FileRecord:
        file_id = new_file_id()
        self._write_content(file_id, content)
        new = NewFile(filename, content, purpose)
        try:
            with self._transaction() as conn:
                return self._insert_file(conn, file_id, tenant, new, expires_at)
        except BaseException:
            self._remove_content(file_id)
            raise

    def file(self, tenant: str | None, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self.conn.execute(
                f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)
            ).fetchone()
        return None if row is None or not _owned(row, tenant) else self._file(row)

    def read_file(self, record: FileRecord) -> bytes:
        return record.path.read_bytes()

    def delete_file(self, tenant: str | None, file_id: str) -> bool:
        record = self.file(tenant, file_id)
        if record is None:
            return False
        with self._transaction() as conn:
            deleted = conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self._remove_content(file_id)  # a crash before this: swept at the next open
        return deleted == 1

    def list_files(
        self,
        tenant: str,
        *,
        limit: int = 10_000,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        purpose: str | None = None,
    ) -> Page:
        where, args = ["tenant = ?"], list[str | int]([tenant])
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append("seq > ?" if order == "asc" else "seq < ?")
            args.append(self._cursor("files", tenant, after))
        direction = "ASC" if order == "asc" else "DESC"
        sql = (
            f"SELECT {_FILE_COLUMNS} FROM files WHERE {' AND '.join(where)}"
            f" ORDER BY seq {direction} LIMIT ?"
        )
        with self._lock:
            rows = self.conn.execute(sql, (*args, limit + 1)).fetchall()
        return Page([self._file(r) for r in rows[:limit]], len(rows) > limit)

    def _remove_content(self, file_id: str) -> None:
        (self.files_dir / file_id).unlink(missing_ok=True)

    def _write_content(self, file_id: str, content: bytes) -> None:
        path = self.files_dir / file_id
        temporary = self.files_dir / f".{file_id}.tmp"
        with open(temporary, "wb") as out:
            out.write(content)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)

    def _insert_file(
        self,
        conn: Statements,
        file_id: str,
        tenant: str,
        new: NewFile,
        expires_at: float | None = None,
    ) -> FileRecord:
        path = self.files_dir / file_id
        record = FileRecord(
            file_id, tenant, new.purpose, new.filename, len(new.content), time.time(),
            expires_at, path,
        )  # fmt: skip
        conn.execute(
            f"INSERT INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (*(getattr(record, c) for c in _FILE_FIELDS[:-1]), file_id),
        )
        return record

    def _file(self, row: Any) -> FileRecord:
        values = dict(row)
        values["path"] = self.files_dir / values["path"]  # relative: the store can move
        return FileRecord(**values)
