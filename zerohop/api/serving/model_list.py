"""`GET /v1/models` and `GET /v1/models/{id}`, in the shape the asking client reads.

- OpenAI (and vLLM): `{"object": "list", "data": [{"id", "object": "model", "created",
  "owned_by", ...}]}`, one card per listed name (vLLM's way with several served names).
- Anthropic: `{"data": [{"type": "model", "id", "display_name", "created_at"}], "has_more",
  "first_id", "last_id"}`, paged by `limit` (1 to 1000, default 20), `after_id` and
  `before_id`. Chosen when the request carries an `anthropic-version` header, which the
  anthropic SDKs send on every request (and Claude Code with them); the OpenAI SDKs never do.
  Their errors are in the Anthropic shape too (app.py).
- Codex CLI's catalog: `{"models": [ModelInfo...]}`, when the query has `client_version`
  (codex-rs `ModelsClient::list_models`: `GET {base_url}/models?client_version=0.x.y`).

Listed: the served names and concrete aliases, never a glob (model_names.py), and only those
the caller's key may use. `GET /v1/models/{id}` answers for any accepted name, listed or
matched by an alias pattern, with that name as the id: what a client asked for is what it
then sends. Ids may hold `/` (Hugging Face style names): the route takes the rest of the path.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from zerohop.api.errors import ApiError
from zerohop.api.http.asgi import Receive, Scope, Send, header, request_id_headers, send_json
from zerohop.api.serving.service import ServingContext
from zerohop.gateway.gateway import Call

Handler = Callable[[Scope, Receive, Send, Call], Awaitable[None]]
MODEL_PATH = "/v1/models/{model_id}"


def routes(ctx: ServingContext) -> dict[tuple[str, str], Handler]:
    models = ModelList(ctx)
    return {("GET", "/v1/models"): models.listing, ("GET", MODEL_PATH): models.retrieve}


def wants_anthropic(scope: Scope) -> bool:
    """An anthropic SDK's request (see the module docstring)."""
    return header(scope, b"anthropic-version") is not None


def query(scope: Scope) -> dict[str, str]:
    parsed = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return {name: values[-1] for name, values in parsed.items()}


class ModelList:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.created = int(time.time())
        self.created_at = datetime.fromtimestamp(self.created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    async def listing(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        names = [name for name in self.ctx.names.listed() if self.ctx.allows(call, name)]
        params = query(scope)
        if "client_version" in params:
            body: dict[str, Any] = {"models": [self.codex_card(n, i) for i, n in enumerate(names)]}
        elif wants_anthropic(scope):
            body = self.anthropic_page(names, params)
        else:
            body = {"object": "list", "data": [self.openai_card(name) for name in names]}
        await send_json(send, 200, body, request_id_headers(call.request_id))

    async def retrieve(self, scope: Scope, receive: Receive, send: Send, call: Call) -> None:
        name = scope["path_params"]["model_id"]
        if not self.ctx.names.accepts(name):
            # The OpenAI API's own message; the Anthropic shape is chosen by app.py.
            message = f"The model `{name}` does not exist."
            raise ApiError(404, message, param="model", code="model_not_found")
        self.ctx.check_model(name, call)
        card = self.anthropic_card(name) if wants_anthropic(scope) else self.openai_card(name)
        await send_json(send, 200, card, request_id_headers(call.request_id))

    # -- the shapes ----------------------------------------------------------------------

    def openai_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "zerohop",
            "root": self.ctx.model_name,  # vLLM's field: the model behind the name
            "parent": None,
            "max_model_len": self.ctx.max_model_len,
        }

    def anthropic_card(self, name: str) -> dict[str, Any]:
        return {"type": "model", "id": name, "display_name": name, "created_at": self.created_at}

    def anthropic_page(self, names: list[str], params: dict[str, str]) -> dict[str, Any]:
        """One page of the Anthropic listing; a cursor naming no listed model is a 400."""
        limit = _limit(params.get("limit"))
        after, before = params.get("after_id"), params.get("before_id")
        if after is not None and before is not None:
            raise ApiError(400, "after_id and before_id cannot be used together")
        if before is not None:
            end = _position(names, before, "before_id")
            page, has_more = names[max(0, end - limit) : end], end - limit > 0
        else:
            start = 0 if after is None else _position(names, after, "after_id") + 1
            page, has_more = names[start : start + limit], start + limit < len(names)
        return {
            "data": [self.anthropic_card(name) for name in page],
            "has_more": has_more,
            "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None,
        }

    def codex_card(self, name: str, priority: int) -> dict[str, Any]:
        """A codex-rs `ModelInfo` (protocol/src/openai_models.rs), every field it requires.

        Decisions: no reasoning levels (the served model's thinking is not an OpenAI effort);
        the shell tool as `shell_command` and apply_patch as a function tool (both plain
        function calls, which the chat surface serves); `base_instructions` empty: this
        server has no Codex prompt of its own (Codex's `model_instructions_file` gives one);
        text input only (image blocks are refused).
        """
        return {
            "slug": name,
            "display_name": name,
            "description": f"{self.ctx.model_name} served by zerohop",
            "supported_reasoning_levels": [],
            "shell_type": "shell_command",
            "visibility": "list",
            "supported_in_api": True,
            "priority": priority,
            "upgrade": None,
            "base_instructions": "",
            "supports_reasoning_summaries": False,
            "support_verbosity": False,
            "default_verbosity": None,
            "apply_patch_tool_type": "function",
            "truncation_policy": {"mode": "bytes", "limit": 10_000},
            "supports_parallel_tool_calls": True,
            "context_window": self.ctx.max_model_len,
            "experimental_supported_tools": [],
            "input_modalities": ["text"],
        }


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    if not value.isdigit() or not 1 <= int(value) <= 1000:
        raise ApiError(400, f"limit: an integer from 1 to 1000, not {value!r}", param="limit")
    return int(value)


def _position(names: list[str], cursor: str, param: str) -> int:
    try:
        return names.index(cursor)
    except ValueError:
        raise ApiError(400, f"{param}: no listed model {cursor!r}", param=param) from None
