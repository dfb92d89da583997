"""What `zerohop serve` keeps in its store beside the keys: message threads, stored
responses, thought-signing keys (each given its repository of the process's one store), and
batches (their store, on the process store's database or file, and their runner)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from zerohop.app.options import ServeOptions
from zerohop.engine.process.supervisor import EngineSupervisor
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.store.sqlite import default_db_path
from zerohop.gateway.store.store import Store

if TYPE_CHECKING:  # imported where each is opened, only when it runs
    from zerohop.api.anthropic.threads import Threads
    from zerohop.api.responses.stored import StoredResponses
    from zerohop.batches.runner import BatchRunner, IdentityFor
    from zerohop.batches.store import AnyBatchStore
    from zerohop.gateway.keys.identity import Identity

log = logging.getLogger("zerohop")


def process_store(gateway: Gateway | None) -> Store:
    """The process's one store: the gateway's, else (a server without a gateway) one in
    memory, kept for the process's lifetime."""
    return gateway.store if gateway is not None else Store.in_memory()


def open_threads(store: Store) -> Threads:
    """The Anthropic surface's message threads, in the store."""
    from zerohop.api.anthropic.threads import Threads

    return Threads(store.threads)


def open_responses(
    store: Store, gateway: Gateway | None = None, ttl: float = 60.0
) -> StoredResponses:
    """The Responses API's stored responses, in the store, background ones leased to this
    replica for `ttl` seconds (its lease keeper's replica id in a fleet)."""
    from zerohop.api.responses.leases import ResponseLeases
    from zerohop.api.responses.stored import StoredResponses

    leases = ResponseLeases(store.responses, replica_id(gateway), ttl)
    return StoredResponses(store.responses, leases=leases)


def replica_id(gateway: Gateway | None) -> str:
    """This replica's id in the fleet: its lease keeper's, else one of its own."""
    from zerohop.gateway.budgets.lease_keeper import LeaseKeeper, new_replica_id

    keeper = getattr(gateway.ledger, "keeper", None) if gateway is not None else None
    return keeper.replica_id if isinstance(keeper, LeaseKeeper) else new_replica_id()


def open_thought_signatures(options: ServeOptions, store: Store) -> Any:
    """Thinking blocks' signing: the store's signing keys, or the operator's
    ZEROHOP_REASONING_SECRET when set."""
    from zerohop.api.serving.thought_signatures import (
        PURPOSE,
        SECRET_ENV,
        ThoughtSignatures,
    )
    from zerohop.gateway.server_keys import ServerKeys

    secret = os.environ.get(SECRET_ENV, "").encode() or None
    keys = ServerKeys(
        store.signing_keys,
        PURPOSE,
        rotation=options.signing_key_rotation,
        operator_secret=secret,
    )
    return ThoughtSignatures(keys, strict=options.strict_thought_signatures)


def open_batches(
    options: ServeOptions, engine: EngineSupervisor, gateway: Gateway | None, store: Store
) -> BatchRunner | None:
    """The batch store in the process's `store` (recovering what a crash left running) and
    its runner, or None."""
    b = options.batches
    if not b.enabled:
        return None
    from zerohop.batches.runner import BatchRunner
    from zerohop.gateway.keys.identity import ANONYMOUS

    batches = _batch_store(options, gateway, store)
    if batches.recovered:
        log.info("batches: %d lines left running by the last process run again", batches.recovered)
    identity_for = _model_identity(gateway) if gateway is not None else lambda _, __: ANONYMOUS
    from zerohop.engine.config import EngineConfig

    engine_options = options.engine_options or {}
    defaults = EngineConfig()
    max_num_seqs = engine_options.get("max_num_seqs") or defaults.max_num_seqs
    target = engine_options.get("inter_token_target", defaults.inter_token_target)
    return BatchRunner(batches, engine, identity_for, int(b.max_share * max_num_seqs), target)


def _batch_store(options: ServeOptions, gateway: Gateway | None, store: Store) -> AnyBatchStore:
    """The batch tables in the fleet store's database, on its pool, when the keys are the
    fleet's (every replica serves every batch), else this server's own SQLite file, opened
    and closed by `store`."""
    from zerohop.batches.store import BatchStore

    if gateway is not None and gateway.auth.spec.kind == "postgresql":
        from zerohop.batches.pg_store import PgBatchStore

        return PgBatchStore.of(store, replica_id(gateway), options.gateway.leases.ttl)
    keys_db = options.gateway.keys_db or default_db_path()
    return BatchStore.of(store, options.batches.db or keys_db.parent / "batches.db")


def _model_identity(gateway: Gateway) -> IdentityFor:
    """A batch line's key as the store has it now (a signed key: as its batch's snapshot
    may serve now), None once it may not call the model."""
    from zerohop.gateway.keys.identity_snapshot import signed_identity_now

    def identity_for(key_id: str, snapshot: dict[str, Any] | None) -> Identity | None:
        if snapshot is not None:
            verifier = gateway.auth.verifier
            if verifier is not None:
                verifier.reload_revoked()
            return signed_identity_now(snapshot, None if verifier is None else verifier.revoked)
        identity = gateway.auth.identity_for(key_id)
        return identity if identity is not None and identity.inference else None

    return identity_for
