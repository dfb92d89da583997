"""Constrained decoding in the engine, on the tiny random-weight model: whatever the weights,
every answer matches its constraint (a JSON schema validated with jsonschema, a regex, a
choice, a Lark grammar) or ends with finish_reason "length"; and constraints keep working
through prefix caching, chunked prefill, preemption, stop strings and continuation, with the
batch never waiting for a grammar to compile."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest

from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE
from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.structured import grammar as g

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "ok"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["id"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["user", "tags"],
    },
    "enum-and-bounds": {
        "type": "object",
        "properties": {
            "level": {"enum": ["low", "mid", "high"]},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["level", "score"],
    },
    "any-of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "maximum": 99, "minimum": 0}, {"type": "null"}]}
        },
        "required": ["value"],
    },
    "array-root": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 4,
    },
    "string-format": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
    },
}
PROMPT = [BOS_ID, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=128, max_num_seqs=16)


def sampled(grammar: str, seed: int, max_tokens: int = 120, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, grammar=grammar, **extra
    )


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = g.json_schema_grammar(schema)
    outs = llm.generate([PROMPT] * 6, [sampled(grammar, seed) for seed in range(6)])
    finished = 0
    for out in outs:
        assert out.error is None
        if out.finish_reason == "length":
            assert len(out.token_ids) == 120
            continue
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema, format_checker=None)
        finished += 1
    assert finished >= 3, "a bounded schema should mostly finish within 120 tokens"


def constrained_ok(out, check) -> None:
    assert out.error is None
    if out.finish_reason != "length":
        assert out.finish_reason == "stop"
        check(out.text)


def test_json_object_regex_choice_and_lark(llm: LLM) -> None:
    lark = 'start: "n=" NUM ("," NUM)*\nNUM: /[1-9][0-9]?/'
    cases = [
        (g.json_object_grammar(), lambda t: isinstance(json.loads(t), dict)),
        (
            g.regex_grammar(r"[a-f]{2,5}-[0-9]{3}"),
            lambda t: re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", t),
        ),
        (g.choice_grammar(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue")),
        (g.lark_grammar(lark), lambda t: re.fullmatch(r"n=[1-9][0-9]?(,[1-9][0-9]?)*", t)),
        (g.lark_grammar('root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
    ]
    for grammar, check in cases:
        outs = llm.generate([PROMPT] * 4, [sampled(grammar, s, 60) for s in range(4)])
        for out in outs:
            constrained_ok(out, lambda t, c=check: c(t) or pytest.fail(repr(t)))
        if grammar != cases[0][0]:  # random weights write long JSON strings
            assert any(o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_greedy_is_constrained_and_unconstrained_rows_untouched(llm: LLM) -> None:
    choice = g.choice_grammar(["alpha", "beta"])
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].token_ids
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, grammar=choice), free])
    assert outs[0].text in ("alpha", "beta") and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == alone, "a constrained row must not change its neighbours"


def test_objects_hold_only_named_properties(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    closed = {**schema, "additionalProperties": False}
    grammar = g.json_schema_grammar(schema)
    outs = llm.generate([PROMPT] * 4, [sampled(grammar, s, max_tokens=400) for s in range(4)])
    assert [out.finish_reason for out in outs] == ["stop"] * 4  # each object was closed
    for out in outs:
        assert out.error is None
        jsonschema.validate(json.loads(out.text), closed)


def test_truncated_json_ends_with_length(llm: LLM) -> None:
    grammar = g.json_schema_grammar(SCHEMAS["nested"])
    out = llm.generate([PROMPT], sampled(grammar, 0, max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{") or out.text.startswith(" ") or out.text.startswith("\n")


def test_stop_string_ends_a_constrained_answer(llm: LLM) -> None:
    grammar = g.regex_grammar("ab(cd)+")
    out = llm.generate([PROMPT], sampled(grammar, 0, 40, stop=["cd"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == "cd" and out.text == "ab"


def test_eos_only_where_the_grammar_accepts(llm: LLM) -> None:
    # Without ignore_eos the model may pick EOS at any point; under a grammar only once the
    # text is complete, so every answer that stopped matches.
    grammar = g.regex_grammar("[a-z]{4}")
    params = [
        SamplingParams(temperature=1.5, seed=s, max_tokens=30, grammar=grammar) for s in range(8)
    ]
    for out in llm.generate([PROMPT] * 8, params):
        assert out.finish_reason == "stop" and re.fullmatch("[a-z]{4}", out.text), out.text


def test_bad_grammar_fails_that_request_only(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        g.json_schema_grammar({"type": "nonsense"})
    bad = SamplingParams(max_tokens=5, grammar='{"grammars": [{"lark_grammar": "start: x"}]}')
    good = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [bad, good])
    assert outs[0].finish_reason == "error" and "compiled" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 5


def test_prefix_cache_chunked_prefill_and_preemption(llama_dir: Path) -> None:
    # 8 blocks of 16 tokens for four requests that grow past two blocks each: preemption by
    # recompute; a step budget of 16 tokens chunks each 40-token prompt.
    llm = LLM(str(llama_dir), num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = [BOS_ID] + [(7 * i) % (VOCAB_SIZE - 4) + 4 for i in range(39)]
    pattern = r"[0-9]{10}(,[0-9]{10}){2}"
    grammar = g.regex_grammar(pattern)

    def run(tag: str) -> tuple[dict[str, str], dict[str, list[int]], int]:
        seqs = []
        for s in range(4):
            engine.add_request(f"{tag}{s}", prompt, sampled(grammar, s, 40))
            seqs.append(engine.requests[f"{tag}{s}"])
        texts: dict[str, str] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                assert delta.error is None
                texts[delta.request_id] = texts.get(delta.request_id, "") + delta.new_text
        tokens = {seq.request_id: seq.output_token_ids for seq in seqs}
        return texts, tokens, sum(seq.num_preemptions for seq in seqs)

    _, first, preemptions = run("a")
    assert preemptions > 0, "the pool is sized to force preemption"
    hits = engine.pool.counters.prefix_hit_tokens
    texts, again, _ = run("b")  # served from the prefix cache
    assert engine.pool.counters.prefix_hit_tokens > hits
    for s in range(4):
        assert re.fullmatch(pattern, texts[f"b{s}"]), texts[f"b{s}"]
        assert first[f"a{s}"] == again[f"b{s}"], "seeded constrained sampling is reproducible"


def test_continuation_replays_the_matcher(llm: LLM) -> None:
    grammar = g.regex_grammar("x{3}y{3}")
    tokenizer = llm.tokenizer
    head = tokenizer.encode("xxxy", add_special_tokens=False)
    engine = llm.engine
    engine.add_request(
        "cont",
        PROMPT + head,
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, grammar=grammar),
        continues=head,
    )
    text = ""
    while engine.has_unfinished():
        for delta in engine.step():
            text += delta.new_text
            if delta.finished:
                assert delta.finish_reason == "stop", delta
    assert text == "yy"


def test_compiling_grammar_never_holds_up_the_batch(llm: LLM) -> None:
    engine = llm.engine
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    grammar = g.choice_grammar(["held", "back"])
    release = threading.Event()
    engine.constraints.compiler._worker.submit(release.wait, 60)  # a compile that takes long
    engine.add_request("free", PROMPT, free)
    engine.add_request("held", PROMPT, SamplingParams(max_tokens=5, grammar=grammar))
    produced = {"free": 0, "held": 0}
    for _ in range(10):
        for delta in engine.step():
            produced[delta.request_id] += len(delta.new_token_ids)
    assert produced == {"free": 10, "held": 0}, "the batch decodes while the grammar compiles"
    release.set()
    text = ""
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == "held":
                text += delta.new_text
    assert text in ("held", "back")


def test_grammar_complete_on_the_last_allowed_token_is_a_stop(llm: LLM) -> None:
    word = "yes"
    length = len(llm.tokenizer.encode(word, add_special_tokens=False))
    params = SamplingParams(temperature=0.0, max_tokens=length, grammar=g.choice_grammar([word]))
    out = llm.generate([PROMPT], params)[0]
    assert out.text == word and out.finish_reason == "stop"
