"""OpenAI Files + Batches end to end: the official `openai` SDK against a real `zerohop serve`
on the tiny model, with a real key store (two tenants) and a real batch store.

One server for the module, slowed to 20 ms a step so that a cancelled batch still has lines
running; uploads are capped at 64 KiB (`--max-batch-bytes`) to show the 413."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.live_server import MODEL_NAME, LiveServer
from tests.test_batches_anthropic import tenant_keys, wait_for

MAX_UPLOAD = 64 * 1024


def chat_line(custom_id: str, max_tokens: int = 3, **body) -> dict:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": messages, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(*lines: dict | bytes) -> bytes:
    return b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return tenant_keys(tmp_path_factory.mktemp("openai_batch_keys") / "keys.db")


@pytest.fixture(scope="module")
def server(llama_dir: Path, keys: dict, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("openai_batch_server")
    args = [
        "--keys-db", str(keys["db"]), "--batches-db", str(folder / "batches.db"),
        "--max-batch-bytes", str(MAX_UPLOAD), "--debug-step-delay", "0.02",
    ]  # fmt: skip
    srv = LiveServer(llama_dir, args)
    srv.start(folder / "server.log")
    yield srv
    srv.stop()


def client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def upload(sdk: openai.OpenAI, content: bytes, name: str = "input.jsonl"):
    return sdk.files.create(file=(name, io.BytesIO(content)), purpose="batch")


def start(sdk: openai.OpenAI, content: bytes, endpoint: str = "/v1/chat/completions"):
    file = upload(sdk, content)
    return sdk.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def finished(sdk: openai.OpenAI, batch_id: str):
    def check():
        batch = sdk.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "cancelled", "expired") else None

    return wait_for(check)


def file_lines(sdk: openai.OpenAI, file_id: str) -> dict[str, dict]:
    rows = [orjson.loads(x) for x in sdk.files.content(file_id).content.splitlines()]
    return {row["custom_id"]: row for row in rows}


def test_chat_batch_writes_output_and_error_files(server, keys):
    sdk = client(server, keys["acme"])
    content = jsonl(
        chat_line("ok-1"),
        chat_line("ok-2", temperature=0),
        chat_line("no-messages", messages=None),
        chat_line("streams", stream=True),
    )
    batch = start(sdk, content)
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert batch.status == "in_progress" and batch.model == MODEL_NAME
    assert batch.request_counts.total == 4
    done = finished(sdk, batch.id)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    output = file_lines(sdk, done.output_file_id)
    assert sorted(output) == ["ok-1", "ok-2"]
    completion = output["ok-1"]["response"]
    assert completion["status_code"] == 200 and output["ok-1"]["error"] is None
    assert completion["body"]["object"] == "chat.completion"
    assert output["ok-1"]["id"].startswith("batch_req_")
    produced = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output.values())
    assert done.usage.output_tokens == produced and done.usage.input_tokens > 0
    errors = file_lines(sdk, done.error_file_id)
    assert sorted(errors) == ["no-messages", "streams"]
    for row in errors.values():
        assert row["response"]["status_code"] == 400 and row["error"] is None
        assert row["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_completions_endpoint(server, keys):
    sdk = client(server, keys["acme"])
    body = {"model": MODEL_NAME, "prompt": "Once upon", "max_tokens": 2}
    line = {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": body}
    done = finished(sdk, start(sdk, jsonl(line), endpoint="/v1/completions").id)
    row = file_lines(sdk, done.output_file_id)["text"]
    assert row["response"]["body"]["object"] == "text_completion"


def test_bad_input_file_fails_the_batch_with_line_numbers(server, keys):
    sdk = client(server, keys["acme"])
    content = jsonl(
        chat_line("a"),
        b"{not json",
        chat_line("a"),
        {**chat_line("wrong-url"), "url": "/v1/completions"},
        chat_line("other-model", model="another-model"),
    )
    batch = start(sdk, content)
    assert batch.status == "failed" and batch.failed_at is not None
    codes = [(e.code, e.line) for e in batch.errors.data]
    assert codes == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("invalid_url", 4),
        ("mismatched_model", 5),
    ]
    assert batch.request_counts.total == 0 and batch.output_file_id is None


def test_a_line_for_a_model_not_served_is_an_error_line(server, keys):
    sdk = client(server, keys["acme"])
    done = finished(sdk, start(sdk, jsonl(chat_line("elsewhere", model="gpt-4o"))).id)
    row = file_lines(sdk, done.error_file_id)["elsewhere"]["response"]
    assert row["status_code"] == 404 and row["body"]["error"]["code"] == "model_not_found"


def test_whole_request_refusals(server, keys):
    sdk = client(server, keys["acme"])
    file = upload(sdk, jsonl(chat_line("a")))
    refusals = [
        dict(endpoint="/v1/embeddings", completion_window="24h"),
        dict(endpoint="/v1/chat/completions", completion_window="1h"),
        dict(endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": 1}),
    ]
    for kwargs in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.batches.create(input_file_id=file.id, **kwargs)
        assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(
            input_file_id="file-nothere", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_large:
        upload(sdk, b"x" * (MAX_UPLOAD + 1))
    assert too_large.value.status_code == 413
    unauthenticated = httpx.get(server.url + "/v1/batches")
    assert unauthenticated.status_code == 401
    assert set(unauthenticated.json()["error"]) == {"message", "type", "param", "code"}


def test_files_list_content_and_delete(server, keys):
    sdk = client(server, keys["beta"])
    made = [upload(sdk, jsonl(chat_line(f"n{i}")), f"in-{i}.jsonl") for i in range(3)]
    assert made[0].filename == "in-0.jsonl" and made[0].bytes == len(jsonl(chat_line("n0")))
    listed = sdk.files.list(purpose="batch", limit=2)
    assert [f.id for f in listed.data] == [f.id for f in made[::-1][:2]] and listed.has_more
    assert [f.id for f in listed] == [f.id for f in made[::-1]]  # the SDK follows `after`
    assert sdk.files.content(made[1].id).content == jsonl(chat_line("n1"))
    deleted = sdk.files.delete(made[1].id)
    assert deleted.deleted and deleted.id == made[1].id
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(made[1].id)


def test_batches_list_pages_newest_first(server, keys):
    sdk = client(server, keys["beta"])
    made = [start(sdk, jsonl(chat_line("a", 1))).id for _ in range(3)]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    assert [b.id for b in sdk.batches.list(limit=2)][:3] == made[::-1]


def test_cancel_writes_cancelled_lines_to_the_error_file(server, keys):
    sdk = client(server, keys["acme"])
    lines = [chat_line(f"long-{i}", 200, temperature=0) for i in range(4)]
    batch = start(sdk, jsonl(*lines))
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    assert cancelling.cancelling_at is not None
    done = finished(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    errors = file_lines(sdk, done.error_file_id)
    assert sorted(errors) == [f"long-{i}" for i in range(4)]
    assert {row["error"]["code"] for row in errors.values() if row["error"]} <= {"batch_cancelled"}


def test_another_tenant_sees_nothing(server, keys):
    owner, other = client(server, keys["acme"]), client(server, keys["beta"])
    done = finished(owner, start(owner, jsonl(chat_line("a", 1))).id)
    for call in (other.batches.retrieve, other.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            call(done.id)
    for file_id in (done.input_file_id, done.output_file_id):
        for call in (other.files.retrieve, other.files.content, other.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=done.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert done.id not in {b.id for b in other.batches.list()}
    assert done.output_file_id not in {f.id for f in other.files.list()}
