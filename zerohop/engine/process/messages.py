"""The messages between the API process and the engine process, typed, and their msgpack form.

To the engine: `Start` (first, once), `Add`, `Abort`, `Call`, `Shutdown`. From it: `Ready` or
`Fatal` (answering `Start`), then `Deltas` once per step (the engine's counters after it ride
along, so the API process answers /metrics without waiting for a step), `Added` when a request
was accepted (its prefix-cache hit as expected now), `Rejected` when its values are invalid,
`Reply` to a `Call`, and `Fatal` when the engine is broken. On the wire each is a list whose
first item names its kind (msgpack has no classes); `to_wire` converts, `to_engine` and
`from_engine` read a frame at its receiving end, and a message of no known kind, or one sent
the wrong way, raises `ValueError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerohop.engine.base.options import EngineOptions
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.client import RequestOptions
from zerohop.engine.process.wire import (
    delta_from_wire,
    delta_to_wire,
    options_from_wire,
    options_to_wire,
    params_from_wire,
    params_to_wire,
)
from zerohop.engine.sample.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class Start:
    model_path: str
    engine_options: EngineOptions


@dataclass(slots=True, frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: RequestOptions


@dataclass(slots=True, frozen=True)
class Abort:
    request_id: str


@dataclass(slots=True, frozen=True)
class Call:
    call_id: int
    name: str  # "stats"


@dataclass(slots=True, frozen=True)
class Shutdown:
    pass


@dataclass(slots=True, frozen=True)
class Ready:
    info: EngineInfo


@dataclass(slots=True, frozen=True)
class Deltas:
    deltas: list[RequestDelta]
    stats: EngineStatsDict | None = None  # the engine's counters after the step


@dataclass(slots=True, frozen=True)
class Added:
    request_id: str
    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True, frozen=True)
class Rejected:
    request_id: str
    message: str


@dataclass(slots=True, frozen=True)
class Reply:
    call_id: int
    value: EngineStatsDict | None = None  # a "stats" call's; None: a name of no call


@dataclass(slots=True, frozen=True)
class Fatal:
    message: str


ToEngine = Start | Add | Abort | Call | Shutdown
FromEngine = Ready | Deltas | Added | Rejected | Reply | Fatal
Message = ToEngine | FromEngine


def to_wire(message: Message) -> list[Any]:
    match message:
        case Add(request_id, prompt, params, options):
            return ["add", request_id, prompt, params_to_wire(params), options_to_wire(options)]
        case Deltas(deltas, stats):
            return ["deltas", [delta_to_wire(d) for d in deltas], stats]
        case Start(model_path, options):
            return ["start", model_path, options]
        case Abort(request_id):
            return ["abort", request_id]
        case Call(call_id, name):
            return ["call", call_id, name]
        case Shutdown():
            return ["shutdown"]
        case Ready(info):
            return ["ready", info]
        case Added(request_id, prompt_tokens, cached_tokens):
            return ["added", request_id, prompt_tokens, cached_tokens]
        case Rejected(request_id, text):
            return ["rejected", request_id, text]
        case Reply(call_id, value):
            return ["reply", call_id, value]
        case Fatal(text):
            return ["fatal", text]
    raise TypeError(f"not an engine message: {type(message).__name__}")


def from_wire(values: Any) -> Message:
    """The message a frame carried; ValueError for one of no known kind or shape."""
    if not isinstance(values, list) or not values:
        raise ValueError(f"not an engine message: {type(values).__name__}")
    kind, *rest = values
    decode = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decode is None:
        raise ValueError(f"unknown engine message {kind!r}")
    try:
        return decode(*rest)
    except TypeError as exc:
        raise ValueError(f"malformed engine message {kind!r}: {exc}") from None


def to_engine(values: Any) -> ToEngine:
    """A frame the engine process received; ValueError for any other."""
    message = from_wire(values)
    if not isinstance(message, ToEngine):
        raise ValueError(f"{type(message).__name__} is a message from the engine process")
    return message


def from_engine(values: Any) -> FromEngine:
    """A frame the API process received; ValueError for any other."""
    message = from_wire(values)
    if not isinstance(message, FromEngine):
        raise ValueError(f"{type(message).__name__} is a message to the engine process")
    return message


def _add(
    request_id: str, prompt: list[int], params: dict[str, Any], options: dict[str, Any]
) -> Add:
    return Add(request_id, prompt, params_from_wire(params), options_from_wire(options))


def _deltas(deltas: list[list[Any]], stats: EngineStatsDict | None = None) -> Deltas:
    return Deltas([delta_from_wire(d) for d in deltas], stats)


# Each kind's decoder, called with the frame's items (msgpack's values: untyped until here).
_DECODERS: dict[str, Callable[..., Message]] = {
    "start": Start,
    "add": _add,
    "abort": Abort,
    "call": Call,
    "shutdown": Shutdown,
    "ready": Ready,
    "deltas": _deltas,
    "added": Added,
    "rejected": Rejected,
    "reply": Reply,
    "fatal": Fatal,
}
