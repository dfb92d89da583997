"""What the composition root adds beside the surfaces' shared context, each typed and each
None where this server does not run it: message threads, stored responses, the batch runner
and the admin API (with the console)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # each is imported where it is opened, only when it runs
    from zerohop.admin.context import AdminContext
    from zerohop.api.anthropic.threads import Threads
    from zerohop.api.responses.stored import StoredResponses
    from zerohop.batches.runner import BatchRunner


@dataclass(slots=True)
class Services:
    threads: Threads | None = None  # None: a request's `thread` is refused
    responses: StoredResponses | None = None  # None: no response is kept
    batches: BatchRunner | None = None  # None: no batch routes
    admin: AdminContext | None = None  # None: no admin API, no /console
