"""Streams keep flowing while new prompts prefill (issue 22, task 2).

A step that carries running decodes takes only the prompt tokens the step-cost model says fit
within the inter-token target (zerohop.engine.sched.prefill_budget); a step with nothing decoding
keeps the whole max_num_batched_tokens. No timing is asserted: the step-cost model is fed
known figures (exact binary fractions, so every budget below is exact), and the scheduler's
chunks and the engine's per-step prompt tokens are checked against them.

Known figures: 8 decodes take 1/32 s (more, linearly more); prefill costs 1/128 s at 8 tokens,
1/16 s at 64 and 1/2 s at 512: p tokens cost p / 1024 s from 8 tokens on, 1/128 s below.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE
from zerohop import LLM, SamplingParams
from zerohop.engine.config import EngineConfig
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.prefill_budget import MAX_SHARE, PrefillBudget, PromptDemand
from zerohop.engine.sched.scheduler import Scheduler, SchedulerOutput
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.step_times import StepCurve, StepTimes

LIMIT = 2048


def known_times() -> StepTimes:
    times = StepTimes()
    times.decode.add(8, 1 / 32)
    times.prefill.add(8, 1 / 128)
    times.prefill.add(64, 1 / 16)
    times.prefill.add(512, 1 / 2)
    return times


def budget(target: float, max_share: float = MAX_SHARE) -> PrefillBudget:
    times = known_times()
    return PrefillBudget(target, lambda: times, max_share=max_share)


# --- the budget from the step-cost model --------------------------------------------------


def test_largest_size_within_a_time() -> None:
    curve = StepCurve.from_rows(known_times().prefill.rows())
    assert curve is not None
    assert curve.largest_within(1 / 128, LIMIT) == 8  # the smallest seen's time covers 1..8
    assert curve.largest_within(96 / 1024, LIMIT) == 96
    assert curve.largest_within(1.0, LIMIT) == 1024  # linear past the largest seen
    assert curve.largest_within(1.0, 700) == 700
    assert curve.largest_within(1 / 256, LIMIT) == 0  # even one token costs more
    assert curve.through_origin().largest_within(1 / 256, LIMIT) == 4  # 1/1024 s a token


def test_a_budget_below_the_smallest_prefill_measured() -> None:
    # Only the start-up calibration's 512-token prefill is known: a flat curve below it would
    # say no token fits beside 8 decodes, and 1-token chunks (timed as decodes) would never
    # teach it otherwise. Per token, 512 tokens' time says 96 fit.
    times = StepTimes()
    times.decode.add(8, 1 / 32)
    times.prefill.add(512, 1 / 2)
    assert PrefillBudget(1 / 8, lambda: times).tokens(8, LIMIT - 8) == 96


@pytest.mark.parametrize(
    ("target", "tokens"),
    [
        (1 / 8, 96),  # 1/8 - 1/32 = 3/32 s for prompt tokens
        (1 / 2, 480),  # 15/32 s
        (4.0, LIMIT - 8),  # all the step has left beside the decodes
        (1 / 16, 32),  # the decodes take half of it: the other half
        (1 / 32, 16),  # the decodes take it all: prompts still get half their time, 1/64 s
        (1 / 64, 16),  # the decodes take more than it
        (0.0, LIMIT - 8),  # no target: the full budget
    ],
)
def test_prompt_tokens_beside_eight_decodes(target: float, tokens: int) -> None:
    assert budget(target).tokens(8, LIMIT - 8) == tokens


def test_nothing_decoding_or_nothing_measured_keeps_the_full_budget() -> None:
    assert budget(1 / 8).tokens(0, LIMIT) == LIMIT
    assert PrefillBudget(1 / 8, StepTimes).tokens(8, LIMIT) == LIMIT


def test_more_decodes_leave_fewer_prompt_tokens() -> None:
    # 16 decodes: past the largest decode batch seen, linear: 1/16 s; 1/16 s left: 64 tokens.
    assert budget(1 / 8).tokens(16, LIMIT) == 64
    # 64 decodes take 1/4 s, past the target: prompts get half of that, 1/8 s.
    assert budget(1 / 8).tokens(64, LIMIT) == 128


def test_at_least_one_prompt_token() -> None:
    times = known_times()
    assert PrefillBudget(1 / 32, lambda: times, share=0.0).tokens(8, LIMIT) == 1


def test_prompt_demand_is_prompt_tokens_arriving_per_output_token() -> None:
    demand = PromptDemand(half_life=64.0)
    demand.arrived(128)
    assert demand.per_output_token() == 0.0  # nothing produced yet: no pace asked
    demand.produced(64)
    assert demand.per_output_token() == 2.0
    demand.produced(64)  # no prompt arrived for 64 outputs: the first ones count half
    assert demand.per_output_token() == 64 / 96
    for _ in range(20):  # a steady mix again
        demand.arrived(128)
        demand.produced(64)
    assert demand.per_output_token() == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize(
    ("per_output_token", "tokens"),
    [
        (1.0, 128),  # 64 a step keep pace: the share's 1/8 s (128 tokens) is more
        (3.0, 192),  # 192 keep pace, within 1.5 times the decodes' 1/4 s
        (10.0, 384),  # 640 would: capped at 1.5 * 1/4 s = 384 tokens
    ],
)
def test_prompts_keep_pace_with_what_arrives(per_output_token: float, tokens: int) -> None:
    paced = budget(1 / 8)  # 64 decodes take 1/4 s, past the target
    paced.demand = PromptDemand(prompt=per_output_token, output=1.0)
    assert paced.tokens(64, LIMIT) == tokens


def test_a_config_target_is_a_finite_number_of_seconds() -> None:
    assert EngineConfig().inter_token_target == 0.15
    assert EngineConfig(inter_token_target=0).inter_token_target == 0
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True, None):
        with pytest.raises(ValueError, match="inter_token_target"):
            EngineConfig(inter_token_target=bad)  # type: ignore[arg-type]


def test_the_serve_flag_and_its_default() -> None:
    from zerohop.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "tiny"])
    assert engine_options(args)["inter_token_target"] == EngineConfig().inter_token_target
    args = build_parser().parse_args(["serve", "tiny", "--inter-token-target", "0.25"])
    assert engine_options(args)["inter_token_target"] == 0.25


@pytest.mark.parametrize("value", ["-0.1", "nan", "inf", "soon"])
def test_serve_refuses_a_bad_target_in_one_line(tmp_path: Path, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerohop", "serve", "tiny", f"--inter-token-target={value}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_DATA_HOME": str(tmp_path)},
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "argument --inter-token-target:" in done.stderr


# --- the scheduler's chunks ----------------------------------------------------------------


def seqs(prefix: str, count: int, length: int, max_tokens: int = 100) -> list[Sequence]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Sequence(f"{prefix}{i}", [i + 1] * length, params, max_tokens) for i in range(count)]


def make_scheduler(prefill_budget: PrefillBudget | None) -> Scheduler:
    pool = BlockPool(512, 16, enable_caching=False)
    return Scheduler(pool, 64, LIMIT, prefill_budget=prefill_budget)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule a step and do what the engine does after the forward pass: advance each
    chunk, and give a completing chunk its next token."""
    out = scheduler.schedule()
    scheduler.stepped(out)
    for chunk in out.chunks:
        completes = chunk.completes
        chunk.seq.num_computed_tokens += chunk.num_tokens
        scheduler.pool.commit(chunk.seq)
        if completes:
            chunk.seq.token_ids.append(7)
    return out


def decoding_streams(scheduler: Scheduler, count: int = 8, length: int = 10) -> list[Sequence]:
    streams = seqs("stream", count, length)
    for seq in streams:
        scheduler.add(seq)
    run_step(scheduler)  # their prefill, with nothing decoding yet
    return streams


def prompt_tokens(out: SchedulerOutput, prompts: list[Sequence]) -> int:
    return sum(c.num_tokens for c in out.chunks if c.seq in prompts)


def prompt_left(prompts: list[Sequence]) -> int:
    return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens) for s in prompts)


def test_a_new_batch_beside_running_streams_is_prefilled_in_chunks() -> None:
    prefill_budget = budget(1 / 8, max_share=0.0)  # the target alone
    scheduler = make_scheduler(prefill_budget)
    streams = decoding_streams(scheduler)
    prompts = seqs("new", 8, 64)
    for seq in prompts:
        scheduler.add(seq)
    chunked = []
    while left := prompt_left(prompts):
        # A prompt's very last token counts as a decode too (one token, one row).
        decodes = sum(1 for s in scheduler.running if s.num_tokens - s.num_computed_tokens == 1)
        decoding = sum(1 for s in scheduler.running if s.num_output_tokens)
        allowed = prefill_budget.tokens(decodes, LIMIT - decodes)
        out = run_step(scheduler)
        scheduled = {id(c.seq): c.num_tokens for c in out.chunks}
        assert all(scheduled.get(id(s)) == 1 for s in streams), "every stream decodes"
        assert out.num_tokens == decoding + min(left, decodes + allowed - decoding)
        chunked.append(left - prompt_left(prompts))
    # More decodes as prompts finish, fewer prompt tokens beside them; 512 in all.
    assert chunked == [96, 92, 88, 80, 76, 72, 8]


def test_without_a_target_the_batch_is_one_step() -> None:
    scheduler = make_scheduler(budget(0.0))
    decoding_streams(scheduler)
    prompts = seqs("new", 8, 64)
    for seq in prompts:
        scheduler.add(seq)
    out = run_step(scheduler)
    assert prompt_tokens(out, prompts) == 512 and out.num_tokens == 520


def test_with_nothing_decoding_a_step_keeps_the_whole_budget() -> None:
    scheduler = make_scheduler(budget(1 / 8))
    prompts = seqs("new", 40, 64)
    for seq in prompts:
        scheduler.add(seq)
    assert run_step(scheduler).num_tokens == LIMIT  # 32 whole prompts
    # The next step carries 32 decodes (1/8 s: the whole target), and 2,560 prompt tokens
    # have arrived for 32 output tokens: prompts get 1.5 times the decodes' time to catch up.
    out = run_step(scheduler)
    assert out.num_tokens == 32 + 192


def test_a_prompt_chunk_ahead_of_decodes_leaves_them_their_tokens() -> None:
    scheduler = Scheduler(BlockPool(64, 16, enable_caching=False), 16, 64)
    streams = decoding_streams(scheduler, 4)
    (long,) = seqs("long", 1, 200)
    scheduler.add(long)
    run_step(scheduler)  # 4 decodes and the long prompt's first 60 tokens
    assert long.num_computed_tokens == 60
    # A state preemption can leave: the prompt still prefilling ahead of the decodes.
    scheduler.running.remove(long)
    scheduler.running.insert(0, long)
    out = run_step(scheduler)
    assert sorted((c.seq.request_id, c.num_tokens) for c in out.chunks) == sorted(
        [("long0", 60), *((s.request_id, 1) for s in streams)]
    )


# --- the engine ----------------------------------------------------------------------------


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(length - 1)]


def serve_arrivals(llm: LLM, target: float) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """8 streams decoding, then 8 new 64-token prompts: each request's tokens, and each
    step's (decodes, prompt tokens), with the step-cost model held at the known figures."""
    engine = llm.engine
    times = known_times()
    engine.scheduler.prefill_budget = PrefillBudget(target, lambda: times)
    rng = random.Random(22)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"stream{i}", random_prompt(rng, 20), params)
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[int, int]] = []
    while engine.has_unfinished():
        if len(steps) == 3:
            for i in range(8):
                engine.add_request(f"new{i}", random_prompt(rng, 64), params)
        deltas = engine.step()
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        decoded = sum(1 for d in deltas if d.new_token_ids and not d.prompt_tokens_processed)
        steps.append((decoded, sum(d.prompt_tokens_processed for d in deltas)))
    return tokens, steps


def test_the_engine_keeps_streams_flowing_and_its_outputs(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=128, max_num_seqs=16, enable_prefix_caching=False)
    before, steps_before = serve_arrivals(llm, 0.0)
    after, steps_after = serve_arrivals(llm, 1 / 8)
    assert after == before, "chunking the prefill changes no token"
    assert max(prompt for _, prompt in steps_before) == 512  # the whole batch beside decodes
    mixed = [(d, p) for d, p in steps_after if d and p]
    assert len(mixed) >= 6 and max(p for _, p in mixed) <= 96
    assert all(d >= 8 for d, _ in mixed), "the 8 streams get a token in every mixed step"
