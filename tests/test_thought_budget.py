"""Thinking budgets (issue 21): a thought is closed by force once it has `thinking_budget`
tokens. The tracker on its own, then the engine on the tiny qwen3 with random weights: the
closing tag's tokens come exactly where the budget runs out, the tokens before are the ones
the unbudgeted request draws, and each of n choices keeps its own count."""

from __future__ import annotations

import pytest

from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError
from zerohop.engine.sample.thought_budget import ThoughtBudget, ThoughtTags

TAGS = ThoughtTags(open_ids=(7, 8), close_ids=(9, 10, 11))
PROMPT = [1, 2, 3]


def walk(budget: ThoughtBudget, output: list[int], steps: int) -> list[int]:
    """Generate `steps` tokens: the forced one when there is one, else the next of `output`."""
    tokens = list(PROMPT)
    free = iter(output)
    for _ in range(steps):
        forced = budget.forced_token(tokens, len(PROMPT))
        tokens.append(next(free) if forced is None else forced)
    return tokens[len(PROMPT) :]


def test_a_thought_the_prompt_opened_is_closed_when_spent() -> None:
    budget = ThoughtBudget(3, TAGS, in_thought=True)
    assert walk(budget, [20, 21, 22, 23, 24, 25, 26], 8) == [20, 21, 22, 9, 10, 11, 23, 24]
    assert budget.closed and not budget.in_thought


def test_a_thought_the_output_opens_is_counted_from_its_tag() -> None:
    budget = ThoughtBudget(2, TAGS)
    out = walk(budget, [30, 7, 8, 40, 41, 42, 43, 44], 9)  # after a token of whitespace
    assert out == [30, 7, 8, 40, 41, 9, 10, 11, 42]


def test_a_tag_later_in_the_answer_opens_no_thought() -> None:
    budget = ThoughtBudget(1, TAGS)
    answer = [30, 31, 32, 33, 34, 35, 36, 7, 8, 37, 38, 39]
    assert walk(budget, answer, 12) == answer
    assert budget.closed and not budget.in_thought


def test_a_thought_the_model_closes_is_not_closed_again() -> None:
    budget = ThoughtBudget(4, TAGS, in_thought=True)
    out = walk(budget, [50, 9, 10, 11, 51, 52, 53, 54, 55], 9)
    assert out == [50, 9, 10, 11, 51, 52, 53, 54, 55]
    assert budget.closed


def test_a_zero_budget_closes_the_thought_at_once() -> None:
    assert walk(ThoughtBudget(0, TAGS, in_thought=True), [20, 21], 5) == [9, 10, 11, 20, 21]


def test_tags_in_the_prompt_do_not_count() -> None:
    budget = ThoughtBudget(1, TAGS)
    tokens = [7, 8, 60, 61]  # the prompt holds an opening tag; its output is not a thought
    assert budget.forced_token(tokens, num_prompt_tokens=4) is None
    assert budget.forced_token([*tokens, 62, 63], num_prompt_tokens=4) is None


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"thinking_budget": -1}, ">= 0"),
        ({"thinking_budget": True}, ">= 0"),
        ({"thinking_budget": 8, "grammar": '{"grammars": []}'}, "grammar"),
    ],
)
def test_bad_budgets_are_refused(fields: dict, error: str) -> None:
    with pytest.raises(InvalidRequestError, match=error):
        SamplingParams(**fields)


@pytest.fixture(scope="module")
def qwen3(tiny_model) -> LLM:
    return LLM(str(tiny_model("qwen3")), num_kv_blocks=64, max_num_seqs=4)


def _prompt(llm: LLM) -> list[int]:
    tokenizer = llm.engine.tokenizer
    return tokenizer.encode("why is the sky blue? <think>", add_special_tokens=False)


def _first_close(tokens: list[int], close: tuple[int, ...]) -> int:
    return next(i for i in range(len(tokens)) if tuple(tokens[i : i + len(close)]) == close)


def test_the_engine_closes_the_thought_at_the_budget(qwen3: LLM) -> None:
    close = qwen3.engine.thought_tags.close_ids
    base = dict(max_tokens=24, ignore_eos=True, seed=7, temperature=1.0)
    free = qwen3.generate(_prompt(qwen3), SamplingParams(**base))[0].token_ids
    params = SamplingParams(**base, thinking_budget=10, thought_open=True)
    capped = qwen3.generate(_prompt(qwen3), params)[0].token_ids
    assert _first_close(capped, close) == 10
    assert capped[:10] == free[:10]
    assert tuple(free[10 : 10 + len(close)]) != close  # the model would not have closed it
    assert len(capped) == 24


def test_each_choice_has_its_own_budget(qwen3: LLM) -> None:
    close = qwen3.engine.thought_tags.close_ids
    params = SamplingParams(
        max_tokens=16, ignore_eos=True, seed=3, n=3, thinking_budget=5, thought_open=True
    )
    choices = qwen3.generate(_prompt(qwen3), params)
    assert len(choices) == 3
    assert all(_first_close(c.token_ids, close) == 5 for c in choices)
