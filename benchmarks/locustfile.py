"""Locust users for the topology comparison (benchmarks/topology.py): streaming OpenAI chat
completions with `Authorization: Bearer $ZEROHOP_API_KEY`, time to first token reported as
a metric of its own.

Locust is not a zerohop dependency: install it into a virtualenv of its own,

    python3 -m venv ~/.cache/zerohop/locust-venv
    ~/.cache/zerohop/locust-venv/bin/pip install locust

then point it at either topology's front door (zerohop direct, or nginx in front of LiteLLM;
a self-signed certificate is accepted):

    ZEROHOP_API_KEY=zh-... ~/.cache/zerohop/locust-venv/bin/locust -f benchmarks/locustfile.py \\
        --host https://127.0.0.1:PORT --headless -u 8 -r 2 -t 60s --csv bench-results/locust

Per request, Locust's table gets three entries: `chat (TTFT)` (request sent -> first chunk
with text), `chat (ITL)` (each gap between two such chunks, one entry per gap) and `chat` (the
whole stream: request sent -> [DONE], response length = output tokens). Locust users are
closed-loop (each waits for its answer, then `wait_time`); for open-loop Poisson arrivals,
as topology.py measures, use `zerohop bench --request-rate`.

Environment:
  ZEROHOP_API_KEY     the key (zerohop: `zerohop keys create ...`; LiteLLM: a virtual key)
  ZEROHOP_MODEL       the model name (default: bench, topology.py's served name)
  ZEROHOP_MAX_TOKENS  output tokens per request (default 64; `ignore_eos` is sent)
  ZEROHOP_WORDS       words per user message (default 100, about 128 prompt tokens)
  ZEROHOP_WAIT_S      think time between a user's requests, uniform 0..this (default 0)
"""

from __future__ import annotations

import json
import os
import random
import string
import sys
import time
from pathlib import Path

from locust import FastHttpUser, between, events, task

# zerohop.sse needs nothing outside the standard library, so Locust's own virtualenv reads
# it from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerohop.sse import Parser

MODEL = os.environ.get("ZEROHOP_MODEL", "bench")
MAX_TOKENS = int(os.environ.get("ZEROHOP_MAX_TOKENS", "64"))
WORDS = int(os.environ.get("ZEROHOP_WORDS", "100"))
WAIT_S = float(os.environ.get("ZEROHOP_WAIT_S", "0"))


def message(rng: random.Random) -> str:
    """Random lowercase words: every prompt its own, so the prefix cache never hits."""
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(WORDS))


class ChatUser(FastHttpUser):
    wait_time = between(0, WAIT_S)
    insecure = True  # the layered stack's nginx has a self-signed certificate

    def on_start(self) -> None:
        key = os.environ.get("ZEROHOP_API_KEY")
        if not key:
            raise RuntimeError("set ZEROHOP_API_KEY to the key to send")
        self.headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        self.rng = random.Random()

    @task
    def chat(self) -> None:
        body = {
            "model": MODEL,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "messages": [{"role": "user", "content": message(self.rng)}],
        }
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True,
            catch_response=True, name="chat",
        ) as response:  # fmt: skip
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.error or ''}")
                return
            # geventhttpclient's response: readline returns each line as soon as it is in
            # (iterating the stream waits for whole blocks, which batches the tokens)
            parser = Parser()
            while line := response.stream.readline(b"\n"):
                for event in parser.feed(line):
                    if event.data is None or event.data.strip() in (b"", b"[DONE]"):
                        continue
                    data = json.loads(event.data)
                    if data.get("error"):
                        response.failure(f"stream error: {data['error']}")
                        return
                    choices = data.get("choices") or ()
                    if not any((c.get("delta") or {}).get("content") for c in choices):
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                        report("chat (TTFT)", (now - start) * 1000)
                    else:
                        report("chat (ITL)", (now - last) * 1000)
                    last = now
                    tokens += 1
            if first is None:
                response.failure("no token in the stream")
            else:
                response.success()
            # the whole stream, not just the response head (what Locust times with stream=True)
            response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            response.request_meta["response_length"] = tokens


def report(name: str, ms: float) -> None:
    events.request.fire(
        request_type="SSE", name=name, response_time=ms, response_length=0, exception=None,
        context={},
    )  # fmt: skip
