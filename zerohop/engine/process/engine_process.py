"""The engine process: owns the model and runs the step loop, driven over a socket.

Messages in: ["add", request_id, prompt_ids, params, options], ["abort", request_id],
["call", call_id, name], ["shutdown"]. Messages out: ["ready", info],
["deltas", [delta, ...], stats] once per step (the engine's counters after it, so the API
process answers /metrics without waiting for a step), ["added", request_id, prompt_tokens,
cached_tokens] when a request was accepted (its prefix-cache hit as expected now: the API
streams `message_start` with it), ["rejected", request_id, message],
["reply", call_id, value], ["fatal", message].

A request that cannot be added is answered alone: "rejected" when its values are invalid
(the API answers 400), or an error delta when adding it failed otherwise (500); the step
loop goes on. Only a broken engine (see `engine.MAX_FAILED_STEPS`) ends it with "fatal".
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import time
import traceback
from typing import Any

from zerohop.engine.config import EngineConfig
from zerohop.engine.engine import LLMEngine
from zerohop.engine.errors import InvalidRequestError
from zerohop.engine.lifecycle import REQUEST_FAILED
from zerohop.engine.outputs import RequestDelta
from zerohop.engine.process.wire import (
    FrameSocket,
    delta_to_wire,
    options_from_wire,
    params_from_wire,
)
from zerohop.engine.start_clock import process_age

log = logging.getLogger(__name__)


def run_engine_process(sock: socket.socket) -> None:
    """Entry point of the child process: the first frame says what to load."""
    channel = FrameSocket(sock)
    if (age := process_age()) is not None:
        log.info("engine start: interpreter and imports in %.2f s", age)
    model_path, options = _read_start_message(channel)
    try:
        engine = LLMEngine(model_path, EngineConfig(**options))
    except Exception as exc:
        channel.send(["fatal", f"{type(exc).__name__}: {exc}"])
        return
    channel.send(["ready", engine_info(engine)])
    try:
        _serve(engine, channel)
    except Exception:
        channel.send(["fatal", traceback.format_exc()])


def _read_start_message(channel: FrameSocket) -> tuple[str, dict[str, Any]]:
    while True:
        channel.wait(None)
        messages = channel.read_available()
        if messages is None:
            raise SystemExit(0)
        if messages:
            assert messages[0][0] == "start", messages[0]
            return messages[0][1], messages[0][2]


def engine_info(engine: LLMEngine) -> dict[str, Any]:
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
            messages = channel.read_available()
            if messages is None:
                return  # the API process is gone
            for message in messages:
                if message[0] == "shutdown":
                    return
                _handle(engine, channel, message)
        if engine.has_unfinished() and engine.background_hold() == 0:
            deltas = engine.step()
            if deltas:
                stats = dataclasses.asdict(engine.stats())
                channel.send(["deltas", [delta_to_wire(d) for d in deltas], stats])
            if engine.config.step_delay:
                time.sleep(engine.config.step_delay)


def _handle(engine: LLMEngine, channel: FrameSocket, message: list) -> None:
    kind = message[0]
    if kind == "add":
        _, request_id, prompt, params, wired = message
        try:
            options = options_from_wire(wired)
            engine.add_request(
                request_id,
                prompt,
                params_from_wire(params),
                tenant=options.tenant,
                weight=options.weight,
                priority=options.priority,
                cache_salt=options.cache_salt,
                continues=list(options.continues) or None,
            )
            channel.send(["added", request_id, len(prompt), engine.prefix_hit(request_id)])
        except (InvalidRequestError, ValueError, TypeError) as exc:
            channel.send(["rejected", request_id, str(exc)])
        except Exception:
            log.exception("engine process: adding request %s failed", request_id)
            failed = RequestDelta(request_id, finished=True, finish_reason="error")
            failed.error = REQUEST_FAILED
            channel.send(["deltas", [delta_to_wire(failed)]])
    elif kind == "abort":
        engine.abort(message[1])
    elif kind == "call":
        _, call_id, name = message
        channel.send(["reply", call_id, _call(engine, name)])
    else:
        log.warning("engine process: unknown message %r", kind)


def _call(engine: LLMEngine, name: str) -> Any:
    if name == "stats":
        return dataclasses.asdict(engine.stats())
    return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    run_engine_process(socket.socket(fileno=int(sys.argv[1])))
