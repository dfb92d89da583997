"""The fleet store's schema in PostgreSQL, as numbered migrations (`zerohop store migrate`).

Each step runs in its own transaction; steps are only ever added, never edited, and stay
additive (new tables, new nullable columns) so replicas one version behind keep working
during a rolling upgrade. `MIN_READER[v]` is the oldest zerohop schema version that may
still serve against a store at version v.

Keys and tenants have the SQLite store's columns (`zerohop.gateway.store.sqlite.SCHEMA`), so
`store_rows` reads a row of either; `change_version` stamps each row with the
`keys_version` of the change that last wrote it. Budgets are held as leases (see
`zerohop.gateway.store.lease_tables`): `budget_state` per (subject, period) has `settled` (spend
reported final) and `leased` (granted to replicas and not yet reported), and every
transaction that touches them keeps settled + leased <= the budget.
"""

from __future__ import annotations

from zerohop.gateway.store.batch_schema import POSTGRES_SCHEMA as BATCHES_SCHEMA
from zerohop.gateway.store.response_tables import LEASES_POSTGRES as RESPONSE_LEASES_SCHEMA
from zerohop.gateway.store.response_tables import POSTGRES_SCHEMA as RESPONSES_SCHEMA
from zerohop.gateway.store.session_tables import POSTGRES_SCHEMA as SESSIONS_SCHEMA
from zerohop.gateway.store.signing_keys import POSTGRES_SCHEMA as SIGNING_KEYS_SCHEMA
from zerohop.gateway.store.thread_tables import POSTGRES_SCHEMA as THREADS_SCHEMA
from zerohop.gateway.store.usage_tables import POSTGRES_END_USER_SCHEMA, POSTGRES_SCHEMA

_KEYS_V1 = """
CREATE TABLE store_meta (name text PRIMARY KEY, value bigint NOT NULL);
INSERT INTO store_meta VALUES ('keys_version', 0);
CREATE TABLE tenants (
    name text PRIMARY KEY, weight double precision NOT NULL DEFAULT 1.0,
    rpm bigint, itpm bigint, otpm bigint, max_concurrency bigint,
    budget_tokens bigint, budget_period text, created double precision NOT NULL,
    change_version bigint NOT NULL DEFAULT 0
);
CREATE TABLE keys (
    key_id text PRIMARY KEY, secret_sha256 text NOT NULL UNIQUE,
    tenant text NOT NULL REFERENCES tenants(name), name text NOT NULL DEFAULT '',
    created double precision NOT NULL, expires double precision, revoked double precision,
    models text NOT NULL DEFAULT '[]', priority text NOT NULL DEFAULT 'interactive',
    rpm bigint, itpm bigint, otpm bigint, max_concurrency bigint,
    budget_tokens bigint, budget_period text,
    change_version bigint NOT NULL DEFAULT 0
);
CREATE INDEX keys_tenant ON keys (tenant);
"""

_LEASES_V1 = """
CREATE TABLE budget_state (
    subject text NOT NULL, period text NOT NULL,
    settled bigint NOT NULL DEFAULT 0, leased bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (subject, period), CHECK (settled >= 0 AND leased >= 0)
);
CREATE TABLE leases (
    lease_id bigserial PRIMARY KEY, replica_id text NOT NULL,
    subject text NOT NULL, period text NOT NULL,
    granted bigint NOT NULL, settled bigint NOT NULL DEFAULT 0,
    state text NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'returned', 'expired')),
    granted_at timestamptz NOT NULL DEFAULT now(), expires_at timestamptz NOT NULL,
    CHECK (settled >= 0 AND settled <= granted)
);
CREATE UNIQUE INDEX leases_one_active ON leases (replica_id, subject, period)
    WHERE state = 'active';
CREATE INDEX leases_due ON leases (expires_at) WHERE state = 'active';
CREATE TABLE replicas (
    replica_id text PRIMARY KEY, host text NOT NULL DEFAULT '', zerohop text NOT NULL DEFAULT '',
    started_at timestamptz NOT NULL DEFAULT now(), heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
);
CREATE TABLE rate_subjects (subject text PRIMARY KEY);
CREATE TABLE rate_shares (
    subject text NOT NULL REFERENCES rate_subjects(subject), replica_id text NOT NULL,
    share double precision NOT NULL CHECK (share >= 0 AND share <= 1),
    demand double precision NOT NULL DEFAULT 0, expires_at timestamptz NOT NULL,
    PRIMARY KEY (subject, replica_id)
);
"""

# Issue 25: admin keys, and usage per minute for the admin API. A zerohop of version 1
# would serve an admin-only key as a data-plane key, so version 2's readers start at 2.
_ADMIN_V2 = (
    """
ALTER TABLE keys ADD COLUMN admin integer NOT NULL DEFAULT 0;
ALTER TABLE keys ADD COLUMN inference integer NOT NULL DEFAULT 1;
ALTER TABLE keys ADD COLUMN archived double precision;
ALTER TABLE keys ADD COLUMN created_by text;
"""
    + POSTGRES_SCHEMA
)

# Issue 38: the Anthropic surface's message threads (zerohop.gateway.store.thread_tables).
# A new table only: a zerohop of version 2 serves as before beside it.
_THREADS_V3 = THREADS_SCHEMA

# The OpenAI Responses API's stored responses (zerohop.gateway.store.response_tables). A new
# table only: a zerohop of version 2 or 3 serves as before beside it.
_RESPONSES_V4 = RESPONSES_SCHEMA

# Issue 42: the server's signing keys (zerohop.gateway.store.signing_keys), so a thought
# signed by one replica verifies on every other and after a restart. A new table only.
_SIGNING_KEYS_V5 = SIGNING_KEYS_SCHEMA

# Issue 42: the console's login sessions (zerohop.gateway.store.session_tables), so any
# replica serves a session and a restart keeps it. A new table only.
_SESSIONS_V6 = SESSIONS_SCHEMA

# Issue 42: Message Batches and OpenAI batches, their lines (leased to the replica running
# them) and files (zerohop.gateway.store.batch_schema). New tables only.
_BATCHES_V7 = BATCHES_SCHEMA

# Issue 51: background responses leased to the replica running them
# (zerohop.gateway.store.response_tables), so a dead replica's response fails within the
# lease and a cancel on any replica stops it. A new table only.
_RESPONSE_LEASES_V8 = RESPONSE_LEASES_SCHEMA

# Issue 51: usage per trusted front's end user (zerohop.gateway.store.usage_tables). A new
# table only: a zerohop of version 2-8 serves beside it, its usage counted unattributed.
_END_USER_USAGE_V9 = POSTGRES_END_USER_SCHEMA

# (version, SQL): applied in order, each in one transaction.
PG_MIGRATIONS: list[tuple[int, str]] = [
    (1, _KEYS_V1 + _LEASES_V1),
    (2, _ADMIN_V2),
    (3, _THREADS_V3),
    (4, _RESPONSES_V4),
    (5, _SIGNING_KEYS_V5),
    (6, _SESSIONS_V6),
    (7, _BATCHES_V7),
    (8, _RESPONSE_LEASES_V8),
    (9, _END_USER_USAGE_V9),
]
MIN_READER: dict[int, int] = {1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2}
SCHEMA_VERSION = PG_MIGRATIONS[-1][0]  # what this zerohop writes and needs
KEYS_CHANNEL = "zerohop_keys"  # NOTIFY channel: a key or tenant changed
