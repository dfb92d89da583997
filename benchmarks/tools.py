"""Tool calls on zerohop's default model (SmolLM2-135M-Instruct) against one `zerohop serve`
(--num-threads 2), as a small agent loop through both official SDKs, streamed: turn 1 forces
a call (OpenAI tool_choice "required", Anthropic {"type": "any"}), the client answers it with
a tool result, turn 2 asks for the final answer with the same conversation (OpenAI
tool_choice "auto": "none" would drop the tools from the prompt, and with them the cached
prefix; Anthropic {"type": "none"}, which keeps them).

  time to call  from sending turn 1 to the call being whole (its arguments delta / its
                content_block_stop), median over --rounds
  ttft          per turn, time to the first streamed token (a content or tool delta)
  cached        turn 2's prompt tokens served from the prefix cache (OpenAI
                prompt_tokens_details.cached_tokens, Anthropic cache_read_input_tokens) over
                its prompt tokens: the conversation reused across turns
  valid         share of forced calls whose arguments pass jsonschema for the tool's schema

    .venv/bin/python benchmarks/tools.py [--rounds 8] [--out bench-results/tools.json]
    .venv/bin/python benchmarks/tools.py --rounds 1 --max-tokens 8  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
from _common import ROOT, model_path, print_table, write_json
from serve import SERVED_MODEL_NAME, Server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome", "Paris"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NAME, DESCRIPTION = "get_weather", "The weather forecast for a city."
CITIES = ["Oslo", "Rome", "Paris"]
SYSTEM = "You are a weather assistant. Use the tool, then answer in one sentence. " * 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: zerohop's default model")
    p.add_argument("--threads", type=int, default=2, help="engine threads")
    p.add_argument("--rounds", type=int, default=8, help="agent loops per SDK")
    p.add_argument("--max-tokens", type=int, default=48, help="turn 2's answer")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / "tools.json")
    args = p.parse_args()
    args.max_num_batched_tokens = 2048  # serve.Server's engine option
    return args


def question(i: int) -> str:
    return f"Round {i}: what will the weather be in {CITIES[i % len(CITIES)]} for 3 days?"


class Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def mark(self) -> float:
        now = time.perf_counter() - self.start
        self.first = now if self.first is None else self.first
        return now


def openai_round(client: openai.OpenAI, i: int, max_tokens: int) -> dict[str, Any]:
    tools = [
        {
            "type": "function",
            "function": {"name": NAME, "description": DESCRIPTION, "parameters": WEATHER},
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question(i)},
    ]
    body = {"model": SERVED_MODEL_NAME, "tools": tools, "temperature": 0, "seed": i}
    clock, call, called = Clock(), {"id": "", "arguments": ""}, None
    stream = client.chat.completions.create(
        **body, messages=messages, tool_choice="required", max_tokens=200, stream=True
    )
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        for tool in (delta and delta.tool_calls) or []:
            at = clock.mark()
            call["id"] = tool.id or call["id"]
            call["arguments"] += tool.function.arguments or ""
            called = at if tool.function.arguments else called
        if delta and delta.content:
            clock.mark()
    arguments = call["arguments"]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": NAME, "arguments": arguments},
            }
        ],
    }
    messages += [assistant, {"role": "tool", "tool_call_id": call["id"], "content": "Sunny."}]
    second, usage = Clock(), None
    stream = client.chat.completions.create(
        **body,
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        tool_choice="auto",
    )
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta and (delta.content or delta.tool_calls):
            second.mark()
        usage = chunk.usage or usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return row(called, clock.first, second.first, arguments, cached, usage.prompt_tokens)


def anthropic_round(client: anthropic.Anthropic, i: int, max_tokens: int) -> dict[str, Any]:
    tools = [{"name": NAME, "description": DESCRIPTION, "input_schema": WEATHER}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question(i)}]
    body = {"model": SERVED_MODEL_NAME, "tools": tools, "system": SYSTEM}
    body["extra_body"] = {"temperature": 0}  # this SDK's stream() has no temperature
    clock, called, block = Clock(), None, None
    with client.messages.stream(
        **body, messages=messages, tool_choice={"type": "any"}, max_tokens=200
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                clock.mark()
            elif event.type == "content_block_stop" and event.content_block.type == "tool_use":
                called, block = clock.mark(), event.content_block
    arguments = json.dumps(block.input) if block is not None else ""
    use = (
        {"type": "tool_use", "id": block.id, "name": NAME, "input": block.input} if block else None
    )
    result = {"type": "tool_result", "tool_use_id": use["id"] if use else "", "content": "Sunny."}
    messages += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    second = Clock()
    with client.messages.stream(
        **body, messages=messages, max_tokens=max_tokens, tool_choice={"type": "none"}
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                second.mark()
        usage = stream.get_final_message().usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    return row(called, clock.first, second.first, arguments, usage.cache_read_input_tokens, prompt)


def row(called, ttft1, ttft2, arguments: str, cached, prompt) -> dict[str, Any]:
    try:
        jsonschema.validate(json.loads(arguments), WEATHER)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {
        "time_to_call_s": called,
        "ttft_turn1_s": ttft1,
        "ttft_turn2_s": ttft2,
        "valid": valid,
        "turn2_cached_tokens": cached or 0,
        "turn2_prompt_tokens": prompt,
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(values) if values else None

    cached = sum(r["turn2_cached_tokens"] for r in rounds)
    prompt = sum(r["turn2_prompt_tokens"] for r in rounds)
    return {
        "rounds": len(rounds),
        "time_to_call_s": median("time_to_call_s"),
        "ttft_turn1_s": median("ttft_turn1_s"),
        "ttft_turn2_s": median("ttft_turn2_s"),
        "valid_share": sum(r["valid"] for r in rounds) / len(rounds),
        "turn2_cached_share": cached / prompt if prompt else 0.0,
    }


def main() -> dict:
    args = parse_args()
    model = model_path(args.model)
    server = Server(args, model, args.threads, args.out.parent / "tools-server.log")
    report: dict[str, Any] = {"model": str(model), "threads": args.threads}
    try:
        server.wait_ready()
        gpt = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        for name, run, client in [
            ("openai", openai_round, gpt),
            ("anthropic", anthropic_round, claude),
        ]:
            print(f"== {name}", flush=True)
            rounds = [run(client, i, args.max_tokens) for i in range(args.rounds)]
            report[name] = {"summary": summary(rounds), "rounds": rounds}
    finally:
        server.stop()
    keys = ["time_to_call_s", "ttft_turn1_s", "ttft_turn2_s", "valid_share", "turn2_cached_share"]
    rows = [
        [name, *(_fmt(report[name]["summary"][k]) for k in keys)]
        for name in ("openai", "anthropic")
    ]
    print_table(["sdk", *keys], rows)
    write_json(args.out, report)
    print(f"\nwrote {args.out}")
    return report


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
