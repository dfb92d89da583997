"""The typed messages between the API process and the engine process survive msgpack framing,
and a frame of no known kind or shape is a clear ValueError, never a crash elsewhere."""

from __future__ import annotations

import pytest

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.base.outputs import RequestDelta
from zerohop.engine.client import RequestOptions
from zerohop.engine.process.messages import (
    Abort,
    Add,
    Added,
    Call,
    Deltas,
    Fatal,
    Message,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Start,
    from_engine,
    from_wire,
    to_engine,
    to_wire,
)
from zerohop.engine.process.wire import HEADER, pack, unpack
from zerohop.engine.sample.sampling_params import SamplingParams


def through_a_frame(message: Message) -> Message:
    framed = pack(to_wire(message))
    (size,) = HEADER.unpack_from(framed)
    assert size == len(framed) - HEADER.size
    return from_wire(unpack(framed[HEADER.size :]))


def a_delta() -> RequestDelta:
    logprobs = [{5: -0.1, 7: -2.5}, {6: -0.3}]
    return RequestDelta("r1", [5, 6], "hi", logprobs, True, "stop", stop_reason=7, index=1)


MESSAGES: list[Message] = [
    Start("/models/m", {"max_num_seqs": 4, "dtype": "bfloat16"}),
    Add(
        "r1",
        [1, 2, 3],
        SamplingParams(temperature=0.5, max_tokens=8, stop=["\n"], logit_bias={7: -100.0}),
        RequestOptions(tenant="acme", weight=2.0, priority=1, cache_salt="s", continues=(4, 5)),
    ),
    Abort("r1"),
    Call(3, "stats"),
    Shutdown(),
    Ready({"max_model_len": 2048, "step_times": [[1, 0.01]]}),
    Deltas([a_delta()], {"num_running": 1}),
    Deltas([a_delta()]),
    Added("r1", 3, 2),
    Rejected("r1", "temperature must be >= 0"),
    Reply(3, {"num_running": 0}),
    Fatal("Traceback ..."),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_comes_back_as_it_was_sent(message: Message) -> None:
    assert through_a_frame(message) == message


@pytest.mark.parametrize(
    ("frame", "says"),
    [
        (["launch", 1], "unknown engine message 'launch'"),
        ([], "not an engine message"),
        ({"kind": "add"}, "not an engine message"),
        (["abort"], "malformed engine message 'abort'"),
        (["add", "r1", [1], {"temperature": 1.0}, {"no_such_option": 1}], "malformed"),
    ],
)
def test_a_frame_of_no_known_kind_or_shape_is_a_value_error(frame: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        from_wire(frame)


def test_an_add_with_invalid_values_raises_the_requests_own_error() -> None:
    frame = to_wire(Add("r1", [1], SamplingParams(), RequestOptions()))
    frame[3]["temperature"] = -1.0
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0"):
        from_wire(frame)


def test_only_messages_are_encoded() -> None:
    with pytest.raises(TypeError, match="not an engine message"):
        to_wire(("abort", "r1"))  # type: ignore[arg-type]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_end_reads_only_the_messages_sent_to_it(message: Message) -> None:
    to_api = isinstance(message, Ready | Deltas | Added | Rejected | Reply | Fatal)
    right, wrong = (from_engine, to_engine) if to_api else (to_engine, from_engine)
    assert right(to_wire(message)) == message
    with pytest.raises(ValueError, match=r"is a message (to|from) the engine process"):
        wrong(to_wire(message))
