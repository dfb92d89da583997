"""zerohop.sse: the one SSE parser the client, `zerohop bench`, the probe and the tests use."""

from __future__ import annotations

import asyncio
import random

from zerohop import sse

BODY = (
    b': zerohop-sent 1.5\nevent: message_start\ndata: {"a":1}\n\n'
    b": ping\n\n"
    b"data: one\ndata: two\n\n"
    b"data:no-space\n\n"
    b"event: named\n\n"
    b"id: 7\n\n"
    b"data: [DONE]\n\n"
    b"data: cut short"
)


def test_events_fields_and_comments() -> None:
    events = sse.parse(BODY)
    assert [(e.name, e.data, e.comments) for e in events] == [
        (b"message_start", b'{"a":1}', (b"zerohop-sent 1.5",)),
        (None, None, (b"ping",)),
        (None, b"one\ntwo", ()),
        (None, b"no-space", ()),
        (b"named", None, ()),
        (None, None, ()),
        (None, b"[DONE]", ()),
    ]
    assert events[0].raw == b': zerohop-sent 1.5\nevent: message_start\ndata: {"a":1}'
    assert b"".join(e.raw + b"\n\n" for e in events) == BODY.rpartition(b"\n\n")[0] + b"\n\n"


def test_any_chunking_gives_the_same_events() -> None:
    rng = random.Random(0)
    crlf = BODY.replace(b"\n", b"\r\n")
    for body in (BODY, crlf):
        whole = sse.parse(body)
        assert [(e.name, e.data, e.comments) for e in whole] == [
            (e.name, e.data, e.comments) for e in sse.parse(BODY)
        ]
        for _ in range(200):
            cuts = sorted(rng.sample(range(1, len(body)), rng.randint(1, 30)))
            chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
            assert list(sse.events(chunks)) == whole


def test_each_feed_returns_the_events_it_completed() -> None:
    parser = sse.Parser()
    assert parser.feed(b"event: a\ndata: 1") == []
    assert [e.data for e in parser.feed(b"\n\ndata: 2\n")] == [b"1"]
    assert [e.data for e in parser.feed(b"\n")] == [b"2"]

    async def chunks():
        for chunk in (b"data: x\n\n", b"data: y\n\n"):
            yield chunk

    async def collect() -> list[bytes | None]:
        return [e.data async for e in sse.aevents(chunks())]

    assert asyncio.run(collect()) == [b"x", b"y"]
