"""Compressed request bodies (content-encoding gzip, deflate, br, zstd) and compressed whole
JSON answers (accept-encoding), on the decoder itself and against a live server from httpx."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable
from typing import Any

import brotli
import httpx
import orjson
import pytest
import zstandard

from tests.live_server import MODEL_NAME, LiveServer
from zerohop.api.errors import ApiError
from zerohop.api.http.content_encoding import decoder_for
from zerohop.api.http.response_encoding import choose


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


CODINGS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "br": lambda data: brotli.compress(data, quality=5),  # 11 takes seconds on a bomb
    "zstd": zstandard.ZstdCompressor().compress,
}
BODY = orjson.dumps({"text": [f"item {i}" for i in range(3000)]})  # ~30 KB
BOMB = b"\0" * (100 * 2**20)  # 100 MB of zeros: ~100 KB gzipped, a few KB in br or zstd


def _decode(coding: str, data: bytes, limit: int, piece: int = 777) -> bytes:
    decoder = decoder_for(coding.encode(), limit)
    assert decoder is not None
    out = [decoder.feed(data[i : i + piece]) for i in range(0, len(data), piece)]
    return b"".join(out) + decoder.finish()


@pytest.mark.parametrize("coding", [*CODINGS, "raw deflate"])
def test_decoder_round_trip_cap_and_bad_data(coding: str) -> None:
    name = coding.split()[-1]
    compress = _raw_deflate if coding == "raw deflate" else CODINGS[coding]
    packed = compress(BODY)
    assert _decode(name, packed, len(BODY)) == BODY  # exactly at the limit: fine
    with pytest.raises(ApiError) as over:
        _decode(name, packed, len(BODY) - 1)
    assert over.value.status == 413 and "decompressed" in over.value.message
    bomb = compress(BOMB[: 16 * 2**20])  # 16 MB against a 1 MB cap
    with pytest.raises(ApiError) as bombed:  # stopped at the cap, never inflated whole
        _decode(name, bomb, 2**20, piece=len(bomb))
    assert bombed.value.status == 413
    with pytest.raises(ApiError) as bad:
        _decode(name, b"\x1f\x8b not " + packed[:40], len(BODY))
    assert bad.value.status == 400 and name in bad.value.message
    if name != "zstd":  # zstandard's stream writer cannot tell a cut-short frame
        with pytest.raises(ApiError) as cut:
            _decode(name, packed[: len(packed) // 2], len(BODY))
        assert cut.value.status == 400


def test_decoder_chains_identity_and_unknown() -> None:
    # `gzip, zstd`: gzipped first, then zstd, so zstd comes off first.
    twice = CODINGS["zstd"](gzip.compress(BODY))
    assert _decode("gzip, zstd", twice, len(BODY)) == BODY
    assert _decode("gzip, identity", gzip.compress(BODY) * 2, 2 * len(BODY)) == BODY * 2
    assert decoder_for(None, 10) is None and decoder_for(b"identity", 10) is None
    with pytest.raises(ApiError) as unknown:
        decoder_for(b"gzip, compress", 10)
    assert unknown.value.status == 415 and "'compress'" in unknown.value.message
    assert unknown.value.headers == [(b"accept-encoding", b"gzip, deflate, br, zstd")]


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (None, None),
        (b"identity", None),
        (b"gzip, deflate", b"gzip"),  # the SDKs' httpx without brotli/zstandard
        (b"gzip, deflate, br, zstd", b"zstd"),
        (b"gzip;q=1, zstd;q=0.5", b"gzip"),
        (b"*", b"zstd"),
        (b"*;q=0", None),
        (b"zstd;q=0, *", b"br"),
        (b"br;q=0.0, gzip;q=0.1, identity", b"gzip"),
        (b"GZIP;Q=0.8", b"gzip"),
        (b"gzip;q=nonsense", None),
    ],
)
def test_choose_honours_accept_encoding(accept: bytes | None, chosen: bytes | None) -> None:
    assert choose(accept) == chosen


REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/messages": {
        "model": MODEL_NAME,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/chat/completions": {
        "model": MODEL_NAME,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/responses": {"model": MODEL_NAME, "max_output_tokens": 2, "input": "hi"},
}


def _post(
    server: LiveServer, path: str, body: bytes, encoding: str, **headers: str
) -> httpx.Response:
    sent = {"content-type": "application/json", "content-encoding": encoding, **headers}
    return httpx.post(server.url + path, content=body, headers=sent, timeout=60)


def test_compressed_bodies_on_every_surface(live_server: LiveServer) -> None:
    for path, request in REQUESTS.items():
        plain = orjson.dumps(request)
        for coding, compress in CODINGS.items():
            answer = _post(live_server, path, compress(plain), coding)
            assert answer.status_code == 200, (path, coding, answer.text)
        chained = CODINGS["zstd"](gzip.compress(plain))
        assert _post(live_server, path, chained, "gzip, zstd").status_code == 200


def test_bombs_bad_data_and_unknown_codings_refused_in_each_shape(
    live_server: LiveServer,
) -> None:
    bomb = gzip.compress(BOMB, compresslevel=9)
    for path in REQUESTS:
        anthropic = path == "/v1/messages"
        for body, coding, status in [
            (bomb, "gzip", 413),
            (b"\x1f\x8bnot gzip at all", "gzip", 400),
            (b"{}", "compress", 415),
        ]:
            answer = _post(live_server, path, body, coding)
            assert answer.status_code == status, (path, coding, answer.text)
            error = answer.json()["error"]
            assert coding in error["message"] or "decompressed" in error["message"]
            if anthropic:
                assert answer.json()["type"] == "error"
                assert error["type"] == (
                    "request_too_large" if status == 413 else "invalid_request_error"
                )
            else:
                assert error["type"] == "invalid_request_error" and "code" in error
        # The server keeps serving.
        plain = orjson.dumps(REQUESTS[path])
        assert _post(live_server, path, plain, "identity").status_code == 200


def test_whole_answers_compressed_as_asked_streams_never(live_server: LiveServer) -> None:
    # Responses echo their instructions: a whole answer well over the 1 KiB minimum.
    request = {**REQUESTS["/v1/responses"], "instructions": "Be brief. " * 150}
    plain = orjson.dumps(request)
    for accept, coding in [("gzip, deflate", "gzip"), ("br", "br"), ("zstd, gzip", "zstd")]:
        answer = _post(
            live_server, "/v1/responses", plain, "identity", **{"accept-encoding": accept}
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-encoding"] == coding
        assert answer.headers["vary"] == "accept-encoding"
        assert int(answer.headers["content-length"]) < len(answer.content)  # httpx decoded it
        assert answer.json()["instructions"] == request["instructions"]
    identity = _post(
        live_server, "/v1/responses", plain, "identity", **{"accept-encoding": "identity"}
    )
    assert identity.status_code == 200 and "content-encoding" not in identity.headers
    assert int(identity.headers["content-length"]) == len(identity.content)
    stream = {**REQUESTS["/v1/chat/completions"], "stream": True}
    headers = {"content-type": "application/json", "accept-encoding": "gzip, br, zstd"}
    url = live_server.url + "/v1/chat/completions"
    with httpx.stream("POST", url, content=orjson.dumps(stream), headers=headers) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in answer.headers
        assert b"data: [DONE]" in b"".join(answer.iter_raw())
