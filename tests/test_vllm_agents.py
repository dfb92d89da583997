"""The agent and fleet checks on vLLM's engine (`zerohop serve --engine vllm`): the real Claude
Code and Codex CLIs, one session each, and a three-replica fleet behind `zerohop.client` (two
replicas on zerohop's engine, one on vLLM's) whose vLLM replica is SIGKILLed mid-stream.

One vLLM server for the module (a start costs ~25-40 s here), shared by both: the CLI
sessions run first, the fleet test last, since it kills the server.

The model: the CLIs' prompts are ~9-13k tokens (SmolLM2's tokenizer), past the built-in
tiny model's 4k context, and vLLM's CPU attention takes head sizes of 32 and up; so every
replica serves the CLI tests' long-context model (tests/fixtures/long_context_model.py: 64k
context, SmolLM2's tokenizer, short turns) built with 32-wide heads. Its end-of-turn and
newline tokens have a constant logit that wins every greedy step (it ends turns at once);
the fleet's greedy streams bias those two away (`logit_bias`, an OpenAI Chat field both
engines honour, and one that a continuation keeps), so that its answers run to max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import openai
import psutil
import pytest
from tokenizers import Tokenizer

from tests.claude_code import ClaudeCode, require_claude_code
from tests.codex import Codex, require_codex
from tests.engines import ENGINE_ARGS, serve_on
from tests.fixtures import long_context_model
from tests.live_server import MODEL_NAME, LiveServer, started_together
from tests.messages_stream import check_stream
from tests.recording_proxy import Exchange, recording
from tests.test_client_failover import ranks_first
from tests.test_codex import check_in_order, events_of
from zerohop.client import ReplicaPool, async_http_client
from zerohop.client.surfaces import ChatCompletions
from zerohop.engine.llm import LLM
from zerohop.engine.sample.sampling_params import SamplingParams
from zerohop.models.default import default_model_path

pytestmark = pytest.mark.timeout(600)

# As the CLI tests' servers: one prefill step takes a whole prompt, room for a session's
# prompts; any model name accepted (Claude Code sends its default model's, Codex gpt-5.5).
SERVER_ARGS = ["--max-num-batched-tokens", "65536", "--num-kv-blocks", "8192"]
ANY_NAME = ["--model-alias", "*"]
HEAD_DIM = 32  # vLLM's CPU attention: 32 and up
PROMPT = "List the files in this folder."  # a new session's one question, as the CLI tests'
# The fleet: zerohop's engines sleep after each step, so their streams last a few seconds;
# the vLLM replica gets the prompts that rank it first (as many as the client's in-flight
# slack lets it place there) and others go to the zerohop ones.
STEP_DELAY = "0.04"
MAX_TOKENS = 48
ON_VLLM, ELSEWHERE = 4, 6
Answer = tuple[list[int], str, int]  # token ids, text, completion tokens of the final usage


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vllm_agents_model") / "model"
    with mock.patch.dict(long_context_model.SHAPE, {"head_dim": HEAD_DIM}):
        return long_context_model.build_long_context_model(folder, default_model_path())


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("vllm_agents_vllm") / "server.log"
    live = serve_on("vllm", model_dir, log, [*SERVER_ARGS, *ANY_NAME])
    assert live.process is not None
    engine_processes = psutil.Process(live.process.pid).children(recursive=True)
    ENGINE_PROCESSES[:] = engine_processes
    yield live
    live.stop()
    for process in engine_processes:  # whatever a failed test left behind
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


# vLLM's EngineCore and worker under the module's vLLM server (its fixture records them).
ENGINE_PROCESSES: list[psutil.Process] = []


def summary(exchanges: list[Exchange]) -> str:
    """Each exchange in a line: path, status, and the error body of a refusal."""
    lines = []
    for e in exchanges:
        error = e.response_body[:300].decode(errors="replace") if e.status >= 400 else ""
        lines.append(f"{e.method} {e.path} -> {e.status} {error}")
    return "\n".join(lines)


def test_claude_code_session_on_vllm(
    vllm_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A new Claude Code session (its default model name, its ~12k-token prompt): every
    request answered 2xx, each stream a well-formed Messages stream, the session a success."""
    require_claude_code()
    work = tmp_path_factory.mktemp("vllm_claude_code")
    claude = ClaudeCode(work / "home", work / "project")
    with recording(vllm_server.url) as proxy:
        run = claude.run(proxy.url, PROMPT)
        exchanges = list(proxy.exchanges)
    assert exchanges, "Claude Code sent nothing"
    refused = [e for e in exchanges if e.status >= 400]
    assert not refused, summary(refused)
    result = run.result
    assert run.returncode == 0, (run.stderr[-2000:], result)
    assert result["subtype"] == "success" and not result["is_error"], result
    assert result.get("api_error_status") is None, result
    streamed = [e for e in exchanges if e.is_stream]
    assert streamed, summary(exchanges)
    for exchange in streamed:
        stream = check_stream(exchange.response_body)
        assert stream.stop_reason in ("end_turn", "max_tokens", "tool_use"), stream
        assert stream.usage.get("output_tokens", 0) >= 1, stream


def test_codex_session_on_vllm(
    vllm_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A new `codex exec` session (gpt-5.5: its tools, apply_patch's Lark grammar): every
    request a 200 on POST /v1/responses, each stream the Responses API's events in order,
    the turn completed with the server's answer as Codex's message."""
    require_codex()
    work = tmp_path_factory.mktemp("vllm_codex")
    codex = Codex(work / "home", work / "project")
    with recording(vllm_server.url) as proxy:
        run = codex.exec(proxy.url, PROMPT)
        exchanges = list(proxy.exchanges)
    assert exchanges, "Codex sent zerohop nothing"
    answered = [(e.method, e.path, e.status) for e in exchanges]
    assert all(status == 200 for *_, status in answered), summary(exchanges)
    assert {(m, p) for m, p, _ in answered} == {("POST", "/v1/responses")}
    assert run.succeeded, run
    for exchange in exchanges:
        check_in_order(events_of(exchange))
    output = events_of(exchanges[-1])[-1]["response"]["output"]
    texts = [p["text"] for i in output if i["type"] == "message" for p in i["content"]]
    assert (run.final_message or "").strip() == "".join(texts).strip()


@pytest.fixture(scope="module")
def zerohop_replicas(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    args = [*ENGINE_ARGS["zerohop"], *SERVER_ARGS, "--debug-step-delay", STEP_DELAY]
    specs = {f"vllm_agents_zerohop{i}": args for i in range(2)}
    with started_together(model_dir, specs, tmp_path_factory) as servers:
        yield list(servers.values())


def banned_tokens(model_dir: Path) -> dict[str, int]:
    """`logit_bias` that rules out the model's end-of-turn and newline tokens."""
    config = json.loads((model_dir / "generation_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    [newline] = tokenizer.encode(long_context_model.NEWLINE, add_special_tokens=False).ids
    return {str(config["eos_token_id"]): -100, str(newline): -100}


def offline_ids(llm: LLM, question: str, bias: dict[str, int]) -> list[int]:
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": question}])
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logit_bias={int(k): float(v) for k, v in bias.items()}
    )
    return list(llm.generate(prompt, params)[0].token_ids)


async def stream_ids(
    client: openai.AsyncOpenAI, question: str, bias: dict[str, int], started: asyncio.Event
) -> Answer:
    """One greedy chat stream's answer; `started` is set once it has three tokens."""
    ids: list[int] = []
    pieces: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias=bias,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or ())
            pieces.append(choice.delta.content or "")
        if len(ids) >= 3:
            started.set()
    assert usage is not None, question
    return ids, "".join(pieces), usage.completion_tokens


def test_fleet_with_a_vllm_replica_killed_mid_stream_loses_no_answer(
    vllm_server: LiveServer, zerohop_replicas: list[LiveServer], model_dir: Path
) -> None:
    """Greedy streams over two zerohop replicas and the vLLM one, through the client; the
    vLLM replica is SIGKILLed while its answers stream: no caller sees an error, and each
    answer is the uninterrupted one of zerohop's offline engine, token for token (vLLM's
    first tokens continued by a zerohop replica), each token counted once. Runs last: the
    module's vLLM server is gone after it."""
    victim = vllm_server.url
    urls = [*(s.url for s in zerohop_replicas), victim]
    bias = banned_tokens(model_dir)
    pool = ReplicaPool(urls, health_interval=0.5)
    pool.start()  # its replicas known, for the affinity ranking
    candidates = (f"Tell me a story about the number {i}." for i in range(10**4))
    on_vllm: list[str] = []
    elsewhere: list[str] = []
    for question in candidates:
        chat = ChatCompletions({"messages": [{"role": "user", "content": question}]})
        first = ranks_first(pool, chat.affinity_text(), victim)
        chosen = on_vllm if first else elsewhere
        if len(chosen) < (ON_VLLM if first else ELSEWHERE):
            chosen.append(question)
        if len(on_vllm) == ON_VLLM and len(elsewhere) == ELSEWHERE:
            break
    questions = on_vllm + elsewhere

    async def run() -> list[Answer | BaseException]:
        client = openai.AsyncOpenAI(
            base_url="http://zerohop/v1",
            api_key="unused",
            max_retries=0,  # any error the transport let through reaches the test
            http_client=async_http_client(pool=pool),
        )
        events = [asyncio.Event() for _ in questions]
        tasks = [
            asyncio.create_task(stream_ids(client, q, bias, e))
            for q, e in zip(questions, events, strict=True)
        ]

        # Kill it once three of its answers stream (vLLM's steps are faster than the
        # delayed zerohop replicas': not waiting for every stream to start).
        async def vllm_streaming() -> None:
            while not (
                sum(e.is_set() for e in events[:ON_VLLM]) >= 3
                and pool.replicas[victim].in_flight >= 3
            ):
                await asyncio.sleep(0.005)

        await asyncio.wait_for(vllm_streaming(), 120)
        assert vllm_server.process is not None
        vllm_server.process.kill()
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        return answers

    try:
        answers = asyncio.run(run())
        stats = pool.stats()
    finally:
        pool.close()
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors  # 0 caller errors
    llm = LLM(model_dir, num_kv_blocks=512, dtype="float32")
    for question, answer in zip(questions, answers, strict=True):
        assert not isinstance(answer, BaseException)
        ids, text, completion_tokens = answer
        want = offline_ids(llm, question, bias)
        assert len(want) == MAX_TOKENS
        assert ids == want, question
        assert text == llm.tokenizer.decode(want), question
        assert completion_tokens == MAX_TOKENS, "usage counts each token once"
    assert stats[victim]["resumes"] >= 3, stats
    assert stats[victim]["breaker"] == "open" or stats[victim]["ready"] is False, stats


def test_vllms_engine_core_ends_with_its_server(vllm_server: LiveServer) -> None:
    """After the fleet test SIGKILLed the vLLM replica's zerohop process: its EngineCore and
    worker (processes ZeroMQ would never tell) end by themselves (engine/vllm/orphan_guard.py),
    not holding their memory on."""
    assert vllm_server.process is not None and vllm_server.process.poll() is not None
    assert ENGINE_PROCESSES
    _, alive = psutil.wait_procs(ENGINE_PROCESSES, timeout=30)
    assert not alive, [p.pid for p in alive]
