"""The gateway `zerohop serve` starts (keys, limits, budgets, audit, metrics over the key
store), and the check that refuses an open server on a public address before the model loads."""

from __future__ import annotations

import ipaddress

from zerohop.app.options import GatewayOptions, ServeOptions
from zerohop.gateway.gateway import Gateway, GatewayStartError
from zerohop.gateway.store.key_snapshot import FILE_NAME, LocalCopy, read_or_load
from zerohop.gateway.store.open_store import StoreSpec, open_database
from zerohop.gateway.store.sqlite import default_db_path


def build_gateway(options: ServeOptions, model_name: str, block_size: int | None) -> Gateway:
    from zerohop.gateway.audit.log import AuditLog
    from zerohop.gateway.metrics import GatewayMetrics

    g = options.gateway
    keys_db = g.keys_db or default_db_path()
    verifier = None
    if g.jwt_public_key is not None:
        from zerohop.gateway.keys.signed_tokens import SignedKeyVerifier

        verifier = SignedKeyVerifier(
            g.jwt_public_key,
            audience=g.jwt_audience,
            revoked_file=g.revoked,
            allow_nonexpiring=g.allow_nonexpiring_signed_keys,
        )
    metrics = GatewayMetrics(model_name, block_size=block_size) if g.metrics else None
    gateway = Gateway.from_store(
        store_spec(g),
        verifier,
        g.durability,
        local_db=keys_db,
        leases=g.leases,
        local_copy=local_copy(g),
        metrics=metrics,
        ledger_failure=g.ledger_failure,
    )
    if g.audit:
        gateway.audit = AuditLog(
            g.audit_dir or keys_db.parent / "audit",
            max_bytes=g.audit_max_bytes,
            include_content=g.audit_content,
            heads=gateway.store.audit_heads,  # the chain head, outside the log's directory
            failure=g.audit_failure,
            max_pending=g.audit_max_pending,
        )
    gateway.start()
    return gateway


def check_open_mode(options: ServeOptions) -> None:
    """Without keys the server is open: only on loopback, unless --allow-anonymous. A
    PostgreSQL store is read here in any case: one that is not migrated, or cannot be
    reached while no local snapshot of its keys can stand in for it, refuses the start at
    once (StoreUnavailable), before the model loads."""
    g, host = options.gateway, options.host
    spec = store_spec(g)
    has_keys = _fleet_has_keys(g) if g.enabled and spec.kind == "postgresql" else None
    if g.allow_anonymous or is_loopback(host):
        return
    if not g.enabled:
        raise GatewayStartError(
            f"--no-gateway serves without keys, and {host} is not a loopback address:"
            " pass --allow-anonymous to serve it anyway"
        )
    if g.jwt_public_key is not None or (has_keys if has_keys is not None else _has_keys(spec)):
        return
    raise GatewayStartError(
        f"no API keys configured ({spec.describe()} has none and no --jwt-public-key) and"
        f" {host} is not a loopback address: create one with `zerohop keys create --tenant"
        " NAME`, or pass --allow-anonymous to serve without keys"
    )


def store_spec(g: GatewayOptions) -> StoreSpec:
    """Where the keys are: --store, else the --keys-db file."""
    return StoreSpec.parse(g.store) if g.store else StoreSpec.sqlite(g.keys_db or default_db_path())


def local_copy(g: GatewayOptions) -> LocalCopy | None:
    """The local snapshot of a fleet store's keys (--store-snapshot, else beside
    --keys-db); None without a fleet store."""
    spec = store_spec(g)
    if spec.kind != "postgresql":
        return None
    path = g.snapshot.path or (g.keys_db or default_db_path()).parent / FILE_NAME
    return LocalCopy(path, spec.describe(), g.snapshot.max_age)


def _fleet_has_keys(g: GatewayOptions) -> bool:
    """Whether the fleet store has keys; while it cannot be reached, whether the local
    snapshot has (StoreUnavailable, in one line, when neither can be read)."""
    from zerohop.gateway.store.pg_key_feed import read_now

    url = store_spec(g).url
    return read_or_load(lambda: read_now(url), local_copy(g), announce=False).has_keys


def _has_keys(spec: StoreSpec) -> bool:
    if spec.kind == "sqlite" and not spec.path.is_file():
        return False  # not created here: `zerohop keys create` does
    store = open_database(spec)
    try:
        return store.has_keys()
    finally:
        store.close()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
