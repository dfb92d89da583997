"""The seam between the store's consumers and its repositories is typed: a misspelt
repository method, a missing argument or an unknown key field is a mypy error (so `make
test` fails on it), while the right calls check clean. Every repository is checked: keys,
ledger, threads, stored responses, leases and audit heads."""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import api

SNIPPET = """
from pathlib import Path

from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store

store = Store.of(StoreSpec.sqlite(Path("keys.db")))
taken = store.threads.take("acme", "msg_1", 0.0, 60.0)
outcome: str = taken.outcome
store.responses.delete("acme", "resp_1", 0.0)
store.ledger.writer("full").spend()
store.leases.heartbeat("replica-1", 60.0, "host", "1.0")
head = store.audit_heads.load(Path("audit"))
if head is not None:
    store.audit_heads.save(Path("audit"), head)
store.keys.create_key("acme", name="ci", priority="batch")
store.threads.take_thread("acme", "msg_1", 0.0, 60.0)
store.responses.get("acme", "resp_1")
store.ledger.write("full")
store.leases.heartbeat("replica-1", 60.0)
store.audit_heads.save(Path("audit"))
store.keys.create_key("acme", nmae="ci")
"""


def test_a_wrong_method_or_a_missing_argument_fails_the_type_check(tmp_path: Path) -> None:
    snippet = tmp_path / "consumer.py"
    snippet.write_text(SNIPPET)
    out, err, status = api.run(
        [
            "--follow-imports=silent",
            "--ignore-missing-imports",
            "--no-error-summary",
            f"--python-version={sys.version_info.major}.{sys.version_info.minor}",
            f"--cache-dir={tmp_path / 'cache'}",
            str(snippet),
        ]
    )
    assert status == 1, (out, err)
    errors = [line.partition(": error: ")[2] for line in out.splitlines() if ": error: " in line]
    assert errors == [
        '"ThreadRepository" has no attribute "take_thread"  [attr-defined]',
        'Missing positional argument "now" in call to "get" of "ResponseRepository"  [call-arg]',
        '"LedgerRepository" has no attribute "write"; maybe "writer"?  [attr-defined]',
        'Missing positional arguments "host", "version" in call to "heartbeat" of'
        ' "LeaseRepository"  [call-arg]',
        'Missing positional argument "head" in call to "save" of "AuditHeadRepository"  [call-arg]',
        'Unexpected keyword argument "nmae" for "create_key" of "KeyRepository"  [call-arg]',
    ], out
