"""Batch lines beside interactive streams are bounded by time, not rows: a step with
interactive decodes carries only the background rows whose measured cost fits a share of its
own; with nothing interactive running the lines run freely."""

from __future__ import annotations

import random

import pytest

from tests.test_prefill_budget import run_step
from zerohop import SamplingParams
from zerohop.engine.config import EngineConfig
from zerohop.engine.sched.background_share import CARRY_STEPS, BackgroundShare
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fair_share import BACKGROUND, INTERACTIVE, VTCPolicy
from zerohop.engine.sched.scheduler import Scheduler
from zerohop.engine.sched.sequence import Sequence
from zerohop.engine.sched.step_times import StepCurve, StepTimes

PARAMS = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
DECODE_ONE, PER_ROW, PER_PROMPT_TOKEN = 0.010, 0.005, 0.004  # seconds


def measured() -> StepTimes:
    """A CPU's shape: a decode step of one row 10 ms, each further row 5 ms; 4 ms a prompt
    token."""
    times = StepTimes()
    for rows in (1, 2, 4, 8, 16, 32, 64):
        times.record(rows, DECODE_ONE + PER_ROW * (rows - 1), rows)
    times.record(512, 512 * PER_PROMPT_TOKEN, 0)
    return times


def seq(tenant: str, priority: int = INTERACTIVE, n: int = 4) -> Sequence:
    return Sequence(f"{tenant}-{random.random()}", [1] * n, PARAMS, 4, tenant, 1.0, priority)


def scheduler_with(share: float, times: StepTimes) -> Scheduler:
    pool = BlockPool(4096, 4, enable_caching=False)
    return Scheduler(pool, 64, 2048, VTCPolicy(), None, BackgroundShare(share, lambda: times))


def started(scheduler: Scheduler, requests: list[Sequence]) -> list[Sequence]:
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)  # their prompts, on an otherwise idle engine
    return requests


def test_lines_run_freely_with_nothing_interactive() -> None:
    scheduler = scheduler_with(0.2, measured())
    lines = started(scheduler, [seq("bulk", BACKGROUND) for _ in range(8)])
    out = run_step(scheduler)
    assert {c.seq for c in out.chunks} == set(lines)


@pytest.mark.parametrize("share", [0.1, 0.2, 0.5])
def test_lines_beside_a_stream_add_at_most_their_share_of_its_time(share: float) -> None:
    times = measured()
    scheduler = scheduler_with(share, times)
    lines = started(scheduler, [seq("bulk", BACKGROUND) for _ in range(8)])
    stream = started(scheduler, [seq("user")])[0]
    decode = StepCurve.from_rows(times.decode.rows())
    assert decode is not None
    steps, added = 200, 0.0
    for _ in range(steps):
        out = run_step(scheduler)
        assert stream in {c.seq for c in out.chunks}, "the stream decodes in every step"
        added += decode(len(out.chunks)) - decode(1)
    # Over many steps the lines add their share, less than one row's cost of rounding.
    assert share * steps * DECODE_ONE - PER_ROW <= added <= share * steps * DECODE_ONE + PER_ROW
    assert sum(line.num_output_tokens for line in lines) >= share * steps * DECODE_ONE / PER_ROW - 1


@pytest.mark.parametrize("underrated", [0.5, 1.0, 3.0])
def test_what_a_step_took_replaces_the_estimate(underrated: float) -> None:
    """Background rows that really cost `underrated` times what the curves say: the engine
    reports each step's time, and the lines still add about their share, no more."""
    times = measured()
    scheduler = scheduler_with(0.2, times)
    started(scheduler, [seq("bulk", BACKGROUND) for _ in range(8)])
    started(scheduler, [seq("user")])
    steps, added = 300, 0.0
    for _ in range(steps):
        out = run_step(scheduler)
        extra = underrated * PER_ROW * (len(out.chunks) - 1)
        scheduler.took(DECODE_ONE + extra)
        added += extra
    share_added = added / (steps * DECODE_ONE)
    assert 0.2 - 0.03 <= share_added <= 0.2 + 0.03, share_added


def test_a_row_dearer_than_the_credit_can_hold_still_runs() -> None:
    times = StepTimes()
    times.record(1, 0.010, 1)
    times.record(2, 0.200, 2)  # a second row measured at 190 ms: more than 8 steps earn
    scheduler = scheduler_with(0.2, times)
    line = started(scheduler, [seq("bulk", BACKGROUND)])[0]
    started(scheduler, [seq("user")])
    for _ in range(CARRY_STEPS + 2):
        run_step(scheduler)
    assert line.num_output_tokens >= 1


def test_share_zero_holds_lines_until_the_stream_ends() -> None:
    scheduler = scheduler_with(0.0, measured())
    lines = started(scheduler, [seq("bulk", BACKGROUND) for _ in range(4)])
    produced = sum(line.num_output_tokens for line in lines)
    stream = started(scheduler, [seq("user")])[0]
    for _ in range(20):
        assert [c.seq for c in run_step(scheduler).chunks] == [stream]
    assert sum(line.num_output_tokens for line in lines) == produced
    scheduler.finish(stream, "stop")
    assert {c.seq for c in run_step(scheduler).chunks} == set(lines)


def test_a_new_lines_prompt_waits_for_the_started_lines_then_fits_the_share() -> None:
    times = measured()
    scheduler = scheduler_with(0.2, times)
    stream = started(scheduler, [seq("user")])[0]
    line = seq("bulk", BACKGROUND, n=40)
    scheduler.add(line)
    chunks = []
    for _ in range(60):
        out = run_step(scheduler)
        assert stream in {c.seq for c in out.chunks}
        chunks += [c.num_tokens for c in out.chunks if c.seq is line]
    # 2 ms a step buys half a prompt token: one token about every other step, never 40 at once
    assert chunks and max(chunks) <= 2
    assert line.num_computed_tokens >= 20


def test_unmeasured_steps_leave_lines_unbounded() -> None:
    scheduler = scheduler_with(0.2, StepTimes())
    lines = started(scheduler, [seq("bulk", BACKGROUND) for _ in range(4)])
    stream = started(scheduler, [seq("user")])[0]
    assert {c.seq for c in run_step(scheduler).chunks} == {stream, *lines}


def test_share_zero_holds_lines_even_before_anything_is_measured() -> None:
    scheduler = scheduler_with(0.0, StepTimes())
    started(scheduler, [seq("bulk", BACKGROUND) for _ in range(4)])
    stream = started(scheduler, [seq("user")])[0]
    assert [c.seq for c in run_step(scheduler).chunks] == [stream]


def test_the_config_share_is_a_finite_non_negative_number() -> None:
    assert EngineConfig().background_step_share == 0.1
    assert EngineConfig(background_step_share=0).background_step_share == 0
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True, None):
        with pytest.raises(ValueError, match="background_step_share"):
            EngineConfig(background_step_share=bad)  # type: ignore[arg-type]


def test_the_serve_flag_and_its_default() -> None:
    from zerohop.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "tiny"])
    assert engine_options(args)["background_step_share"] == EngineConfig().background_step_share
    args = build_parser().parse_args(["serve", "tiny", "--batch-step-share", "0.5"])
    assert engine_options(args)["background_step_share"] == 0.5
