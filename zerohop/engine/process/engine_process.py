"""The engine process: owns the model and runs the step loop, driven over a socket with the
typed messages of `zerohop.engine.process.messages` (`Start` first, then `Add`, `Abort`, `Call`,
`Shutdown`; it answers `Ready`, then `Deltas` once per step, `Added`, `Rejected`, `Reply`, or
`Fatal`).

A request that cannot be added is answered alone: `Rejected` when its values are invalid
(the API answers 400), or an error delta when adding it failed otherwise (500); the step
loop goes on. Only a broken engine (see `engine.MAX_FAILED_STEPS`) ends it with `Fatal`.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
import traceback
from typing import Any

from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.base.outputs import EngineInfo, EngineStatsDict, RequestDelta
from zerohop.engine.config import EngineConfig
from zerohop.engine.engine import LLMEngine
from zerohop.engine.lifecycle import REQUEST_FAILED
from zerohop.engine.process.messages import (
    Abort,
    Add,
    Added,
    Call,
    Deltas,
    Fatal,
    FromEngine,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Start,
    ToEngine,
    to_engine,
    to_wire,
)
from zerohop.engine.process.wire import FrameSocket
from zerohop.engine.start_clock import process_age

log = logging.getLogger(__name__)


def run_engine_process(sock: socket.socket) -> None:
    """Entry point of the child process: the first message says what to load."""
    channel = FrameSocket(sock)
    if (age := process_age()) is not None:
        log.info("engine start: interpreter and imports in %.2f s", age)
    start = _read_start_message(channel)
    try:
        engine = LLMEngine(start.model_path, EngineConfig(**start.engine_options))
    except Exception as exc:
        _send(channel, Fatal(f"{type(exc).__name__}: {exc}"))
        return
    _send(channel, Ready(engine_info(engine)))
    try:
        _serve(engine, channel)
    except Exception:
        _send(channel, Fatal(traceback.format_exc()))


def _send(channel: FrameSocket, message: FromEngine) -> None:
    channel.send(to_wire(message))


def _read_start_message(channel: FrameSocket) -> Start:
    while True:
        channel.wait(None)
        frames = channel.read_available()
        if frames is None:
            raise SystemExit(0)
        if frames:
            try:
                start = to_engine(frames[0])
            except ValueError as exc:
                raise SystemExit(f"engine process: expected Start first: {exc}") from None
            if not isinstance(start, Start):
                raise SystemExit(f"engine process: expected Start first, got {start!r}")
            return start


def engine_info(engine: LLMEngine) -> EngineInfo:
    return {
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.model_config.vocab_size,
        "num_blocks": engine.pool.num_blocks,
        "block_size": engine.config.block_size,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.model.device),
        "start_phases": engine.start_clock.phases,
        "step_times": engine.throughput.step_times.table(),  # what a restart reuses
    }


def _serve(engine: LLMEngine, channel: FrameSocket) -> None:
    while True:
        idle = not engine.has_unfinished()
        if channel.wait(None if idle else engine.background_hold()):
            frames = channel.read_available()
            if frames is None:
                return  # the API process is gone
            for frame in frames:
                message = _decode(channel, frame)
                if isinstance(message, Shutdown):
                    return
                if message is not None:
                    _handle(engine, channel, message)
        if engine.has_unfinished() and engine.background_hold() == 0:
            deltas = engine.step()
            if deltas:
                _send(channel, Deltas(deltas, engine.stats().as_dict()))
            if engine.config.step_delay:
                time.sleep(engine.config.step_delay)


def _decode(channel: FrameSocket, frame: Any) -> ToEngine | None:
    """The message a frame carries; None (after rejecting the request, if it was one) for a
    frame that does not decode: a request with invalid values (SamplingParams checks them)."""
    try:
        return to_engine(frame)
    except ValueError as exc:
        if isinstance(frame, list) and len(frame) > 1 and frame[0] == "add":
            _send(channel, Rejected(str(frame[1]), str(exc)))
        else:
            log.warning("engine process: %s", exc)
        return None


def _handle(engine: LLMEngine, channel: FrameSocket, message: ToEngine) -> None:
    match message:
        case Add():
            _add(engine, channel, message)
        case Abort(request_id):
            engine.abort(request_id)
        case Call(call_id, name):
            _send(channel, Reply(call_id, _call(engine, name)))
        case _:
            log.warning("engine process: unexpected %s", type(message).__name__)


def _add(engine: LLMEngine, channel: FrameSocket, message: Add) -> None:
    request_id, prompt, options = message.request_id, message.prompt_token_ids, message.options
    try:
        engine.add_request(
            request_id,
            prompt,
            message.params,
            tenant=options.tenant,
            weight=options.weight,
            priority=options.priority,
            cache_salt=options.cache_salt,
            continues=list(options.continues) or None,
        )
        _send(channel, Added(request_id, len(prompt), engine.prefix_hit(request_id)))
    except (InvalidRequestError, ValueError, TypeError) as exc:
        _send(channel, Rejected(request_id, str(exc)))
    except Exception:
        log.exception("engine process: adding request %s failed", request_id)
        failed = RequestDelta(request_id, finished=True, finish_reason="error")
        failed.error = REQUEST_FAILED
        _send(channel, Deltas([failed]))


def _call(engine: LLMEngine, name: str) -> EngineStatsDict | None:
    if name == "stats":
        return engine.stats().as_dict()
    return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    run_engine_process(socket.socket(fileno=int(sys.argv[1])))
