"""`n` > 1 choices: the engine prefills the prompt once and forks the choices with shared KV
blocks (zerohop/engine/sched/fork.py); the OpenAI surfaces return, stream and count every choice."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import openai
import orjson
import pytest

from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE
from tests.live_server import MODEL_NAME, LiveServer
from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.engine import LLMEngine

BLOCK = 16


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(length - 1)]


def greedy(max_tokens: int = 10, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def sampled(seed: int | None, max_tokens: int = 12, **extra) -> SamplingParams:
    extra.setdefault("ignore_eos", True)
    return SamplingParams(seed=seed, max_tokens=max_tokens, **extra)


PROMPT = random_prompt(20, 37)  # two full blocks and a partial one: the fork copies it


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=128, max_num_seqs=16, block_size=BLOCK)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


# -- engine ------------------------------------------------------------------------------


@dataclass
class Run:
    """What one request's deltas said, by choice index."""

    tokens: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    reasons: dict[int, str] = field(default_factory=dict)
    prompt_tokens_processed: int = 0
    max_preemptions: int = 0


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> Run:
    engine.add_request(request_id, prompt, params)
    out = Run()
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id == request_id and delta.index not in out.reasons
            out.tokens[delta.index].extend(delta.new_token_ids)
            out.prompt_tokens_processed += delta.prompt_tokens_processed
            if delta.finished:
                out.reasons[delta.index] = delta.finish_reason
        seqs = engine.requests.values()
        out.max_preemptions = max([out.max_preemptions, *(s.num_preemptions for s in seqs)])
    return out


def check_pool_idle(engine: LLMEngine) -> None:
    assert not any(engine.pool.ref_counts), "a block is still referenced"
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.requests and not engine.scheduler.running
    assert not engine.forks.child_of and not engine.forks.families


def test_greedy_choices_are_identical_and_equal_n_1(llm: LLM) -> None:
    want = llm.generate([PROMPT], greedy())[0].token_ids
    outs = llm.generate([PROMPT], greedy(n=3))
    assert [o.index for o in outs] == [0, 1, 2]
    assert tokens(outs) == [want] * 3
    assert all(o.finish_reason == "length" for o in outs)
    assert len({o.text for o in outs}) == 1


def test_seeded_choices_reproduce_and_each_is_seed_plus_index(llm: LLM) -> None:
    outs = tokens(llm.generate([PROMPT], sampled(42, n=4)))
    assert tokens(llm.generate([PROMPT], sampled(42, n=4))) == outs
    assert len({tuple(t) for t in outs}) == 4, "every choice samples on its own"
    # Choice i draws as a lone request seeded seed + i would: the fork gave it the very
    # cache (shared blocks, copied partial block) and logits a prefill of its own would.
    alone = [llm.generate([PROMPT], sampled(42 + i))[0].token_ids for i in range(4)]
    assert outs == alone


def test_a_prompt_of_whole_blocks_forks_without_a_copy(llm: LLM) -> None:
    prompt = random_prompt(21, 2 * BLOCK)
    outs = tokens(llm.generate([prompt], sampled(7, n=3)))
    assert outs == [llm.generate([prompt], sampled(7 + i))[0].token_ids for i in range(3)]


def test_prompt_is_prefilled_once_and_blocks_shared(llm: LLM) -> None:
    engine = llm.engine
    prompt = random_prompt(23, 37)  # not in the prefix cache: all 37 tokens are computed
    engine.add_request("shared", prompt, greedy(n=4))
    processed = 0
    while not engine.forks.families:  # until the step that forks
        processed += sum(d.prompt_tokens_processed for d in engine.step())
    parent = engine.requests["shared"]
    full = parent.block_table[:2]
    assert [engine.pool.ref_counts[b] for b in full] == [4, 4]
    tables = [s.block_table for s in engine.requests.values()]
    assert len(tables) == 4 and all(t[:2] == full for t in tables)
    assert len({t[2] for t in tables}) == 4, "each choice has its own partial block"
    assert engine.stats().blocks_in_use == 2 + 4
    while engine.has_unfinished():
        processed += sum(d.prompt_tokens_processed for d in engine.step())
    assert processed == len(prompt), "the prompt was computed once"
    check_pool_idle(engine)


def test_prefill_counted_once_in_deltas(llm: LLM) -> None:
    prompt = random_prompt(24, 50)
    out = run(llm.engine, "count", prompt, sampled(3, n=5))
    assert out.prompt_tokens_processed == len(prompt)
    assert sorted(out.reasons) == list(range(5)) and set(out.reasons.values()) == {"length"}
    assert all(len(out.tokens[i]) == 12 for i in range(5))
    check_pool_idle(llm.engine)


def test_choices_survive_preemption_in_a_tiny_pool(llama_dir: Path, llm: LLM) -> None:
    # 8 blocks; four choices that grow to 37 + 40 tokens (5 blocks each) cannot all fit.
    tiny = LLM(str(llama_dir), num_kv_blocks=8, max_num_seqs=8, block_size=BLOCK)
    params = sampled(5, max_tokens=40, n=4)
    out = run(tiny.engine, "tight", PROMPT, params)
    assert out.max_preemptions > 0, "the pool was meant to run dry"
    assert [out.tokens[i] for i in range(4)] == tokens(llm.generate([PROMPT], params))
    assert set(out.reasons.values()) == {"length"}
    check_pool_idle(tiny.engine)


def test_children_without_blocks_or_slots_prefill_on_their_own(llama_dir: Path) -> None:
    # 3 blocks: the parent's 37-token prompt takes all, so no child gets a copy at once.
    tiny = LLM(str(llama_dir), num_kv_blocks=3, max_num_seqs=4, block_size=BLOCK)
    want = tiny.generate([PROMPT], greedy(6))[0].token_ids
    out = run(tiny.engine, "queued", PROMPT, greedy(6, n=3))
    assert [out.tokens[i] for i in range(3)] == [want] * 3
    check_pool_idle(tiny.engine)
    # Two slots, one taken by another request: the child waits for a slot.
    two = LLM(str(llama_dir), num_kv_blocks=32, max_num_seqs=2, block_size=BLOCK)
    two.engine.add_request("other", random_prompt(22, 5), greedy(30))
    outs = two.generate([PROMPT], greedy(6, n=2))
    assert tokens(outs) == [want] * 2
    while two.engine.has_unfinished():
        two.engine.step()
    check_pool_idle(two.engine)


def test_abort_mid_way_ends_every_choice_and_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("gone", PROMPT, sampled(None, max_tokens=200, n=4))
    for _ in range(5):
        engine.step()
    assert len(engine.requests) == 4 and engine.stats().blocks_in_use > 0
    engine.abort("gone")
    deltas = engine.step()
    assert sorted(d.index for d in deltas) == [0, 1, 2, 3]
    assert all(d.request_id == "gone" and d.finish_reason == "abort" for d in deltas)
    check_pool_idle(engine)


def test_n_above_max_num_seqs_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        llm.engine.add_request("too-many", PROMPT, greedy(n=17))
    assert not llm.engine.has_unfinished()


# -- OpenAI API (live server) --------------------------------------------------------------

CHAT = [{"role": "user", "content": "Name three colours."}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="any", max_retries=0)


def test_chat_n_3_greedy_and_seeded(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    want = llm.generate([ids], greedy(8))[0]
    got = client(live_server).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0, n=3
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert all(c.message.content == want.text for c in got.choices)
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == 3 * len(want.token_ids)
    assert got.usage.total_tokens == len(ids) + 3 * len(want.token_ids)

    offline = llm.generate([ids], sampled(11, max_tokens=8, n=3, ignore_eos=False))
    seeded = client(live_server).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, seed=11, n=3, logprobs=True
    )
    assert [c.message.content for c in seeded.choices] == [o.text for o in offline]
    assert [c.finish_reason for c in seeded.choices] == [o.finish_reason for o in offline]
    for choice, out in zip(seeded.choices, offline, strict=True):
        assert len(choice.logprobs.content) == len(out.token_ids)
    assert seeded.usage.completion_tokens == sum(len(o.token_ids) for o in offline)


def test_chat_n_3_stream_interleaves_choices(live_server: LiveServer, llm: LLM) -> None:
    ids = llm.tokenizer.encode_chat(CHAT)
    offline = llm.generate([ids], sampled(12, max_tokens=8, n=3, ignore_eos=False))
    stream = client(live_server).chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=8,
        seed=12,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text: dict[int, str] = defaultdict(str)
    roles: dict[int, int] = defaultdict(int)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        choice = chunk.choices[0]
        assert not finishes[choice.index], "nothing after a choice's finish chunk"
        if choice.delta.role:
            roles[choice.index] += 1
            assert not text[choice.index], "the role opens the choice"
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert roles == {0: 1, 1: 1, 2: 1}
    assert [text[i] for i in range(3)] == [o.text for o in offline]
    assert [finishes[i] for i in range(3)] == [[o.finish_reason] for o in offline]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == sum(len(o.token_ids) for o in offline)


def test_completions_n_3_whole_and_streamed(live_server: LiveServer, llm: LLM) -> None:
    prompt = "The quick brown fox"
    ids = llm.tokenizer.encode(prompt)
    offline = llm.generate([ids], sampled(13, max_tokens=6, n=3, ignore_eos=False, logprobs=1))
    sdk = client(live_server)
    options = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "seed": 13, "n": 3}
    got = sdk.completions.create(**options, logprobs=1)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [o.text for o in offline]
    for choice, out in zip(got.choices, offline, strict=True):
        assert len(choice.logprobs.tokens) == len(out.token_ids)
        assert choice.finish_reason == out.finish_reason
    assert got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in offline)

    chunks = list(
        sdk.completions.create(**options, stream=True, stream_options={"include_usage": True})
    )
    text: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        text[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert [text[i] for i in range(3)] == [o.text for o in offline]
    assert [finishes[i] for i in range(3)] == [o.finish_reason for o in offline]
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


@pytest.mark.parametrize("n", [0, 129])
def test_n_out_of_range_is_a_400_naming_n(live_server: LiveServer, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(live_server).chat.completions.create(model=MODEL_NAME, messages=CHAT, n=n)
    assert bad.value.param == "n"


def test_client_resumes_n_choices_only_before_any_was_sent() -> None:
    """zerohop.client's failover continues one answer: n > 1 mid-answer starts no other."""
    from zerohop.client.surfaces import ChatCompletions

    chunk = {"id": "c", "choices": [{"index": 1, "delta": {"content": "a"}, "token_ids": [5]}]}
    event = b"data: " + orjson.dumps(chunk) + b"\n\n"
    for n, resumable in ((None, True), (1, True), (2, False)):
        surface = ChatCompletions({"stream": True, "messages": CHAT, "n": n})
        assert surface.resumable
        surface.feed(event)
        assert surface.resumable is resumable
