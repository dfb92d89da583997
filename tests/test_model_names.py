"""The model names agent harnesses ask for: served names, alias patterns, and `GET /v1/models`
in the OpenAI, Anthropic and Codex CLI shapes (zerohop/api/serving/model_names.py, model_list.py).

The listings run in process (the ASGI app over httpx's ASGI transport, the official SDKs on
top): no engine is needed to list models. Generation under an alias runs on a live server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import grpc
import httpx
import httpx2
import openai
import pytest

from tests.live_server import LiveServer
from zerohop.api.serving.model_names import ModelNames, check_name
from zerohop.api.serving.service import ServingContext
from zerohop.app.routes import create_app
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.gateway.auth import Authenticator
from zerohop.gateway.gateway import Call, Gateway, GatewayError
from zerohop.gateway.keys.identity import Identity, Tenant
from zerohop.gateway.store.spec import StoreSpec
from zerohop.gateway.store.store import Store
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2 as pb
from zerohop.grpc_gen.zerohop.v1 import zerohop_pb2_grpc as pb_grpc

SERVED = ["tiny-llama", "tiny-llama-v1", "org/tiny", "claude-*"]
ALIASES = ["gpt-5*", "codex-local"]
LISTED = ["tiny-llama", "tiny-llama-v1", "org/tiny", "codex-local"]
CLAUDE = "claude-sonnet-4-5-20250929"

# -- the names accepted --------------------------------------------------------------------


def test_no_flags_accept_any_name() -> None:
    names = ModelNames.from_flags("tiny", None, None)
    assert names.primary == "tiny" and names.any_name
    assert names.accepts(CLAUDE) and names.accepts("gpt-5-codex") and names.accepts("x")
    assert names.listed() == ("tiny",)


def test_naming_the_model_makes_the_set_explicit() -> None:
    names = ModelNames.from_flags("ckpt", SERVED, ALIASES)
    assert names.served == ("tiny-llama", "tiny-llama-v1", "org/tiny")
    assert names.aliases == ("claude-*", "gpt-5*", "codex-local")
    assert names.listed() == tuple(LISTED)  # globs are never listed
    for name in ["tiny-llama", "org/tiny", CLAUDE, "claude-haiku-4-5", "gpt-5-codex"]:
        assert names.accepts(name), name
    for name in ["ckpt", "Claude-x", "gpt-4o", "codex-local-2"]:
        assert not names.accepts(name), name
    # Only aliases: the checkpoint's name is served, with them; no flag value: only it.
    assert ModelNames.from_flags("ckpt", None, ["claude-*"]).listed() == ("ckpt",)
    assert not ModelNames.from_flags("ckpt", None, []).accepts(CLAUDE)
    assert ModelNames.from_flags("ckpt", ["mine"], ["*"]).accepts(CLAUDE)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "cannot be empty"),
        ("two words", "no spaces"),
        ("tab\tname", "no spaces"),
        ("claude-[45", "must close"),
        ("a[b[c]]", "must close"),
        ("x" * 257, "at most 256"),
    ],
)
def test_bad_names_are_refused(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_name(text)


@pytest.mark.parametrize("good", ["claude-*", "gpt-5?", "m[0-9]", "org/model", "a]b"])
def test_good_names(good: str) -> None:
    assert check_name(good) == good


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--model-alias", "claude-[x"], "argument --model-alias: 'claude-[x': a '['"),
        (["--served-model-name", ""], "argument --served-model-name: a model name cannot"),
    ],
)
def test_a_bad_flag_is_a_cli_error(flags: list[str], why: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerohop", "serve", "tiny", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_key_allowed_the_model_may_use_its_aliases(tmp_path: Path) -> None:
    names = ModelNames.from_flags("ckpt", ["tiny-llama"], ["claude-*"])
    store = Store.of(StoreSpec.sqlite(tmp_path / "keys.db"))
    gateway = Gateway(store, Authenticator(tmp_path / "keys.db", store.keys), None)
    ctx = ServingContext(None, None, "ckpt", 2048, names=names, gateway=gateway)  # type: ignore[arg-type]
    call = Call("req_1", "anthropic")
    call.identity = Identity("k1", Tenant("t"), models=("tiny-llama",))
    ctx.check_model(CLAUDE, call)  # an alias of the model the key may use
    assert call.model == CLAUDE  # audited as the name the request used
    call.identity = Identity("k2", Tenant("t"), models=("claude-opus-4",))
    ctx.check_model("claude-opus-4", call)  # the name the key lists
    with pytest.raises(GatewayError) as refused:
        ctx.check_model(CLAUDE, call)
    assert refused.value.status == 403


# -- the listings, in process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def app(llama_dir: Path):
    names = ModelNames.from_flags("ckpt", SERVED, ALIASES)
    ctx = ServingContext(None, Tokenizer.from_dir(llama_dir), "ckpt", 2048, names=names)  # type: ignore[arg-type]
    return create_app(ctx)


def _run(app, use):
    """`use(http)`: an httpx.AsyncClient on the app, awaited."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://zerohop") as http:
            return await use(http)

    return asyncio.run(main())


def test_openai_sdk_lists_and_retrieves(app) -> None:
    async def use(http: httpx.AsyncClient):
        sdk = openai.AsyncOpenAI(api_key="k", base_url="http://zerohop/v1", http_client=http)
        listed = (await sdk.models.list()).data
        assert [(m.id, m.object, m.owned_by) for m in listed] == [
            (name, "model", "zerohop") for name in LISTED
        ]
        assert {m.model_extra["root"] for m in listed} == {"tiny-llama"}
        for name in ["gpt-5-codex", "org/tiny", "tiny-llama-v1"]:  # a match echoes its name
            assert (await sdk.models.retrieve(name)).id == name
        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-4o")
        assert missing.value.code == "model_not_found" and "gpt-4o" in missing.value.message

    _run(app, use)


def test_anthropic_sdk_lists_and_retrieves(app) -> None:
    async def use(_: httpx.AsyncClient):
        # This anthropic SDK is on httpx2: its own ASGI transport.
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app))
        sdk = anthropic.AsyncAnthropic(api_key="k", base_url="http://zerohop", http_client=http)
        page = await sdk.models.list()
        assert [(m.id, m.type, m.display_name) for m in page.data] == [
            (name, "model", name) for name in LISTED
        ]
        assert page.has_more is False and (page.first_id, page.last_id) == (LISTED[0], LISTED[-1])
        assert page.data[0].created_at.year >= 2025
        model = await sdk.models.retrieve(CLAUDE)
        assert (model.id, model.type) == (CLAUDE, "model")
        with pytest.raises(anthropic.NotFoundError) as missing:
            await sdk.models.retrieve("gpt-4o")
        assert missing.value.body["error"]["type"] == "not_found_error"  # the Anthropic shape
        # Paging, as the SDK's auto-pagination walks it.
        first = await sdk.models.list(limit=2)
        assert [m.id for m in first.data] == LISTED[:2] and first.has_more
        assert [m.id async for m in await sdk.models.list(limit=1)] == LISTED
        before = await sdk.models.list(before_id="codex-local", limit=2)
        assert [m.id for m in before.data] == LISTED[1:3] and before.has_more
        with pytest.raises(anthropic.BadRequestError):
            await sdk.models.list(after_id="no-such-model")

    _run(app, use)


def test_codex_catalog(app) -> None:
    async def use(http: httpx.AsyncClient):
        response = await http.get("/v1/models", params={"client_version": "0.99.0"})
        assert response.status_code == 200
        return response.json()

    models = _run(app, use)["models"]
    assert [m["slug"] for m in models] == LISTED
    # Every field codex-rs's ModelInfo needs to decode (openai_models.rs: no serde default).
    required = {
        "slug", "display_name", "description", "supported_reasoning_levels", "shell_type",
        "visibility", "supported_in_api", "priority", "upgrade", "base_instructions",
        "supports_reasoning_summaries", "support_verbosity", "default_verbosity",
        "apply_patch_tool_type", "truncation_policy", "supports_parallel_tool_calls",
        "experimental_supported_tools",
    }  # fmt: skip
    assert required <= set(models[0])
    assert models[0]["context_window"] == 2048 and models[0]["visibility"] == "list"
    assert models[0]["truncation_policy"] == {"mode": "bytes", "limit": 10_000}


# -- generation under an alias, on a live server ---------------------------------------------


@pytest.fixture(scope="module")
def named_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    flags = ["--served-model-name", *SERVED, "--model-alias", *ALIASES]
    log = tmp_path_factory.mktemp("named") / "server.log"
    server = LiveServer(llama_dir, flags, served_model_name=None).start(log)
    yield server
    server.stop()


MESSAGES = [{"role": "user", "content": "Hello"}]


def test_messages_echo_the_alias(named_server: LiveServer) -> None:
    sdk = anthropic.Anthropic(api_key="k", base_url=named_server.url)
    message = sdk.messages.create(model=CLAUDE, max_tokens=4, messages=MESSAGES)
    assert message.model == CLAUDE
    with sdk.messages.stream(model="claude-haiku-4-5", max_tokens=4, messages=MESSAGES) as s:
        assert s.get_final_message().model == "claude-haiku-4-5"
    assert sdk.messages.count_tokens(model=CLAUDE, messages=MESSAGES).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="gpt-4o", max_tokens=4, messages=MESSAGES)
    assert "gpt-4o" in missing.value.message and "tiny-llama" in missing.value.message


def test_chat_echoes_the_alias(named_server: LiveServer) -> None:
    sdk = openai.OpenAI(api_key="k", base_url=named_server.url + "/v1")
    answer = sdk.chat.completions.create(model="gpt-5-codex", max_tokens=4, messages=MESSAGES)
    assert answer.model == "gpt-5-codex"
    stream = sdk.chat.completions.create(
        model="codex-local", max_tokens=4, messages=MESSAGES, stream=True
    )
    assert {chunk.model for chunk in stream} == {"codex-local"}
    assert sdk.completions.create(model="org/tiny", prompt="Hi", max_tokens=2).model == "org/tiny"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", max_tokens=4, messages=MESSAGES)
    assert [m.id for m in sdk.models.list().data] == LISTED


def test_grpc_takes_the_alias(named_server: LiveServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{named_server.grpc_port}") as channel:
        stub = pb_grpc.ZerohopStub(channel)
        request = pb.GenerateRequest(model=CLAUDE, prompt="Hi", max_tokens=2, temperature=0)
        assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=60)) == 2
        counted = stub.CountTokens(pb.CountTokensRequest(model="gpt-5", prompt="Hi"), timeout=60)
        assert counted.input_tokens > 0
        with pytest.raises(grpc.RpcError) as missing:
            list(stub.Generate(pb.GenerateRequest(model="gpt-4o", prompt="Hi"), timeout=60))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
