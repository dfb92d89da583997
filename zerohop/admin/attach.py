"""Gives a serving gateway what the operator's routes read: usage per minute, live load,
and the admin context the routes and the console share (console sessions in the gateway's
store)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from zerohop.admin.context import AdminContext
from zerohop.admin.service import AdminService
from zerohop.admin.sessions import SessionStore
from zerohop.api.load.live_load import LiveLoad
from zerohop.gateway.gateway import Gateway
from zerohop.gateway.usage import UsageRecorder


def attach_operator(gateway: Gateway, secure_cookies: bool) -> AdminContext:
    """Start recording usage and live load on `gateway`; the admin context over it."""
    store = gateway.store
    gateway.usage = UsageRecorder(store.usage)
    gateway.usage.start()
    gateway.live = LiveLoad()
    sessions = SessionStore(store.sessions)
    return AdminContext(
        gateway, AdminService.of(gateway), sessions=sessions, secure_cookies=secure_cookies
    )


class LiveSampler:
    """The once-a-second sampling of the live load, for the server's lifetime."""

    def __init__(self, admin: AdminContext, stats: Callable[[], Any]) -> None:
        self.admin, self.stats = admin, stats
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        live = self.admin.gateway.live
        assert isinstance(live, LiveLoad)  # attach_operator made it
        self._task = asyncio.create_task(live.run(self.stats))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
