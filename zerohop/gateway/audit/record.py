"""One audit record: a JSON object, one line of the log.

Its fields are the request's (`zerohop.gateway.gateway.audit_entry`), an admin action's, or a
loss marker's, plus `seq`, `prev` and `hash` that the log adds; values are whatever JSON holds,
so they are `Any` here and each reader checks the type of the field it reads.
"""

from __future__ import annotations

from typing import Any, TypeAlias

AuditRecord: TypeAlias = dict[str, Any]
