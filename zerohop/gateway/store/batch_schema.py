"""The batch tables in the PostgreSQL fleet store (zerohop.batches.pg_store): the columns of
the SQLite `batches.db` (zerohop.batches.schema), with file contents in the database rather than
on one replica's disk, and each running line leased to the replica that runs it.

- `lines.lease_owner` / `lease_until`: the replica running the line and when its lease ends
  (unix seconds); the runner renews its leases every tick, and any replica puts a running
  line whose lease ended back to waiting (or errors it after too many attempts).
- `file_contents`: one row per file, dropped with it.

SQL text only: the gateway holds the migrations, and never imports the batches package.
"""

POSTGRES_SCHEMA = """
CREATE TABLE files (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id text NOT NULL UNIQUE,
    tenant text NOT NULL, purpose text NOT NULL, filename text NOT NULL, bytes bigint NOT NULL,
    created_at double precision NOT NULL, expires_at double precision, path text NOT NULL
);
CREATE INDEX files_by_tenant ON files (tenant, seq);
CREATE TABLE file_contents (
    id text PRIMARY KEY REFERENCES files(id) ON DELETE CASCADE, content bytea NOT NULL
);
CREATE TABLE batches (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, id text NOT NULL UNIQUE,
    tenant text NOT NULL, key_id text NOT NULL,
    api text NOT NULL CHECK (api IN ('anthropic', 'openai')),
    endpoint text NOT NULL, model text, status text NOT NULL,
    created_at double precision NOT NULL, expires_at double precision NOT NULL,
    ended_at double precision, cancel_initiated_at double precision,
    expired_at double precision, archived_at double precision,
    completion_window text, input_file_id text, output_file_id text, error_file_id text,
    metadata text, errors text, usage text, identity text
);
CREATE INDEX batches_by_tenant ON batches (tenant, api, seq);
CREATE INDEX batches_by_status ON batches (status, seq);
CREATE TABLE lines (
    batch_id text NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    idx bigint NOT NULL, custom_id text NOT NULL, params text NOT NULL,
    state text NOT NULL, result text, attempts bigint NOT NULL DEFAULT 0,
    started_at double precision, finished_at double precision,
    lease_owner text, lease_until double precision,
    PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, custom_id)
);
CREATE INDEX lines_by_state ON lines (batch_id, state, idx);
CREATE INDEX lines_running ON lines (batch_id) WHERE state = 'running';
CREATE INDEX lines_leased ON lines (lease_until) WHERE state = 'running';
"""
