"""The Virtual Token Counter policy: fair share between tenants, weights, priority classes,
and the lift that keeps an idle tenant from banking service; then the same in the engine."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE
from tests.test_prefill_budget import run_step
from zerohop import LLM, SamplingParams
from zerohop.engine.sched.block_pool import BlockPool
from zerohop.engine.sched.fair_share import BACKGROUND, BATCH, INTERACTIVE, VTCPolicy
from zerohop.engine.sched.policy import TokenUsage
from zerohop.engine.sched.scheduler import Scheduler
from zerohop.engine.sched.sequence import Sequence, Status

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def seq(tenant: str, weight: float = 1.0, priority: int = INTERACTIVE, n: int = 8) -> Sequence:
    return Sequence(f"{tenant}-{random.random()}", [1] * n, PARAMS, 4, tenant, weight, priority)


def admit(policy: VTCPolicy, output_tokens: int = 0) -> Sequence:
    """Admit the policy's choice (charged its prompt) and charge `output_tokens` of output."""
    chosen = policy.peek()
    assert chosen is not None
    policy.remove(chosen)
    policy.admitted(chosen)
    policy.charge([TokenUsage(chosen.request_id, chosen.tenant, 0, output_tokens)])
    return chosen


def test_a_flooding_tenant_does_not_hold_back_another() -> None:
    policy = VTCPolicy()
    for _ in range(20):
        policy.add(seq("flood"))
    for _ in range(5):
        assert admit(policy).tenant == "flood"
    policy.add(seq("one"))
    assert policy.counters["one"] == policy.counters["flood"] == 40, "lifted, not ahead"
    # A tie goes to the tenant backlogged last: the flood was served up to the counter the
    # newcomer was lifted to, while the newcomer waited for nothing.
    assert [admit(policy).tenant for _ in range(2)] == ["one", "flood"], "ties: newcomer first"
    assert len(policy) == 14


def test_service_follows_the_weights() -> None:
    policy = VTCPolicy()
    for _ in range(400):
        policy.add(seq("light", weight=1.0))
        policy.add(seq("heavy", weight=2.0))
    served = Counter(admit(policy, output_tokens=3).tenant for _ in range(300))
    assert abs(served["heavy"] / served["light"] - 2.0) < 0.05, served


def test_output_tokens_weigh_double_by_default() -> None:
    """Long prompts against long answers: per admission, 'reads' costs 24 (prompt 24), and
    'writes' 24 as well (prompt 8 + 8 output tokens at weight 2): they alternate."""
    policy = VTCPolicy()
    for _ in range(50):
        policy.add(seq("reads", n=24))
        policy.add(seq("writes", n=8))
    served = Counter()
    for _ in range(60):
        chosen = policy.peek()
        assert chosen is not None
        policy.remove(chosen)
        policy.admitted(chosen)
        output = 8 if chosen.tenant == "writes" else 0
        policy.charge([TokenUsage(chosen.request_id, chosen.tenant, 0, output)])
        served[chosen.tenant] += 1
    assert served == {"reads": 30, "writes": 30}
    assert policy.counters["reads"] == policy.counters["writes"] == 720


def test_an_idle_tenant_cannot_bank_service() -> None:
    policy = VTCPolicy()
    for _ in range(30):
        policy.add(seq("busy"))
    for _ in range(20):
        admit(policy)
    assert policy.counters["busy"] == 160
    policy.add(seq("late"))
    assert policy.counters["late"] == 160, "lifted to the smallest backlogged counter"
    for _ in range(5):
        policy.add(seq("late"))
    order = [admit(policy).tenant for _ in range(6)]
    assert order == ["late", "busy"] * 3, order


def test_the_lift_uses_the_last_admitted_tenant_when_nobody_waits() -> None:
    policy = VTCPolicy()
    policy.add(seq("a", n=500))
    admit(policy)
    policy.add(seq("b"))
    assert policy.counters["b"] == 500


def test_interactive_before_batch_and_batch_preempted_first() -> None:
    policy = VTCPolicy()
    background = [seq("bulk", priority=BATCH) for _ in range(3)]
    for s in background:
        policy.add(s)
    policy.add(seq("bulk", priority=INTERACTIVE))
    first = admit(policy, output_tokens=1000)
    assert first.priority == INTERACTIVE, "interactive work is admitted first, whatever its counter"
    chat = seq("chat")
    assert policy.victim([chat, *background[:2]]) in background[:2]
    heavy, light = seq("heavy"), seq("light")
    policy.counters.update({"heavy": 900.0, "light": 10.0})
    assert policy.victim([light, heavy]) is heavy, "within a class: the most-served tenant"


def test_requeued_requests_resume_first() -> None:
    policy = VTCPolicy()
    first, second = seq("t"), seq("t")
    policy.add(first)
    policy.add(second)
    assert admit(policy) is first
    policy.requeue(first)
    assert policy.peek() is first
    policy.remove(second)  # an abort from the middle of a queue
    assert len(policy) == 1 and policy.peek() is first


# --- in the engine --------------------------------------------------------------------


def _admission_order(llama_dir: Path, scheduling_policy: str) -> list[str]:
    """Tenant A queues 6 requests, then B one; with room for one sequence at a time, the
    order in which they start."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_seqs=1, scheduling_policy=scheduling_policy)
    engine = llm.engine
    rng = random.Random(3)
    prompt = [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"a{i}", prompt, params, tenant="a")
    started: list[str] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id not in started:
                started.append(delta.request_id)
        if len(started) == 1 and "b0" not in engine.requests and "b0" not in started:
            engine.add_request("b0", prompt, params, tenant="b")
    return started


def test_the_engine_admits_the_least_served_tenant(llama_dir: Path) -> None:
    vtc = _admission_order(llama_dir, "vtc")
    # b is lifted to a's counter (a is backlogged); a0's later output tokens put a ahead.
    assert vtc.index("b0") == 1, vtc
    fcfs = _admission_order(llama_dir, "fcfs")
    assert fcfs.index("b0") == 6, fcfs


def test_an_unknown_policy_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(str(llama_dir), scheduling_policy="lottery")


# --- through the API ------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_slot_server(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.live_server import LiveServer

    log = tmp_path_factory.mktemp("one_slot") / "server.log"
    server = LiveServer(llama_dir, ["--max-num-seqs", "1", "--debug-step-delay", "0.02"])
    yield server.start(log)
    server.stop()


@pytest.mark.parametrize("lowering", [{"service_tier": "flex"}, {"priority": 1}])
def test_a_request_can_lower_itself_to_batch(one_slot_server, lowering: dict) -> None:
    """One sequence at a time: behind a running request, a batch request that arrived first
    starts after an interactive one that arrived later."""
    import asyncio

    import httpx

    from tests.live_server import MODEL_NAME, engine_has

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=one_slot_server.url, timeout=60) as client:

            async def ask(name: str, max_tokens: int, **extra) -> None:
                body = {"model": MODEL_NAME, "prompt": name, "max_tokens": max_tokens, **extra}
                response = await client.post("/v1/completions", json={**body, "ignore_eos": True})
                assert response.status_code == 200, response.text
                finished.append(name)

            hog = asyncio.create_task(ask("hog", 40))
            await engine_has(client, running=1, waiting=0)  # the hog holds the one slot
            batch = asyncio.create_task(ask("batch", 2, **lowering))
            await engine_has(client, running=1, waiting=1)  # the batch request waits behind it
            await asyncio.gather(hog, batch, ask("interactive", 2))
        return finished

    finished = asyncio.run(run())
    assert finished == ["hog", "interactive", "batch"], finished


def start(policy: VTCPolicy, running: list[Sequence]) -> list[Sequence]:
    """`running` through the queue and admitted, as the scheduler would."""
    for s in running:
        policy.add(s)
        policy.remove(s)
        policy.admitted(s)
    return running


def test_full_slots_make_room_for_interactive_and_for_an_unserved_tenant() -> None:
    policy = VTCPolicy()
    bulk = start(policy, [seq("bulk", priority=BATCH) for _ in range(3)])
    chat = seq("chat")
    policy.add(chat)
    assert policy.displace(chat, bulk) is bulk[-1], "batch yields to interactive (newest first)"

    hogs = start(policy, [seq("hog") for _ in range(4)])
    light = seq("light")
    policy.add(light)
    assert policy.displace(light, hogs) is hogs[-1], "over its share (4 of 4 slots)"
    assert policy.displace(light, [*hogs[:2], light]) is None, "it holds a slot already"
    other = seq("other")
    policy.add(other)
    assert policy.displace(other, [hogs[0], light]) is None, "nobody holds over its share"
    assert policy.displace(seq("hog", priority=BATCH), hogs) is None, "batch never displaces"


# --- background requests (batch lines) in the scheduler --------------------------------------


def scheduled_step(scheduler: Scheduler) -> list[Sequence]:
    """A step as the engine runs it: the requests it computed."""
    return [c.seq for c in run_step(scheduler).chunks]


def background_scheduler(num_blocks: int, lines: int) -> tuple[Scheduler, list[Sequence]]:
    scheduler = Scheduler(BlockPool(num_blocks, 4, enable_caching=False), 16, 256, VTCPolicy())
    background = [seq("bulk", priority=BACKGROUND, n=4) for _ in range(lines)]
    for line in background:
        scheduler.add(line)
    scheduled_step(scheduler)  # their prompts
    return scheduler, background


def test_background_lines_sit_out_the_step_of_an_interactive_prompt() -> None:
    scheduler, background = background_scheduler(64, 3)
    assert set(scheduled_step(scheduler)) == set(background)  # decoding on an idle engine
    user = seq("user", n=8)
    scheduler.add(user)
    assert scheduled_step(scheduler) == [user]  # its prompt alone: as fast as on idle
    assert set(scheduled_step(scheduler)) == {user, *background}  # then they decode beside it
    assert all(line.status is Status.RUNNING for line in background)  # kept their blocks


def test_background_lines_give_way_when_blocks_run_out() -> None:
    # 3 lines of 4 + 1 tokens hold 6 of 7 blocks: the prompt's 2 blocks need one of theirs.
    scheduler, background = background_scheduler(7, 3)
    user = seq("user", n=8)
    scheduler.add(user)
    steps = [scheduled_step(scheduler) for _ in range(3)]
    assert user in steps[0] or user in steps[1], "the prompt starts at once, not after them"
    assert any(line.num_preemptions for line in background)
    assert user.status is Status.RUNNING


def test_background_lines_linger_after_foreground_work() -> None:
    scheduler, background = background_scheduler(64, 2)
    assert scheduler.background_hold(0.05) == 0.0  # no foreground work yet: no wait
    user = seq("user", n=4)
    scheduler.add(user)
    assert scheduler.background_hold(0.05) == 0.0  # it waits: step now
    scheduled_step(scheduler)
    scheduler.finish(user, "stop")
    assert 0.0 < scheduler.background_hold(0.05) <= 0.05  # the client's next request may come
    assert scheduler.background_hold(0.0) == 0.0
    scheduler.foreground_at -= 0.05
    assert scheduler.background_hold(0.05) == 0.0
    assert set(scheduled_step(scheduler)) == set(background)


def test_a_new_background_prompt_lingers_too() -> None:
    scheduler = Scheduler(BlockPool(64, 4, enable_caching=False), 16, 256, VTCPolicy())
    user = seq("user", n=4)
    scheduler.add(user)
    scheduled_step(scheduler)
    scheduler.finish(user, "stop")
    scheduler.add(seq("bulk", priority=BACKGROUND, n=4))
    assert scheduler.background_hold(0.05) > 0.0


def test_an_interactive_prompt_is_not_chunked_for_decodes_that_sit_out() -> None:
    # A prefill budget that allows no prompt token beside a decode: were the sitting-out
    # lines counted, the prompt would go one token a step.
    from zerohop.engine.sched.prefill_budget import PrefillBudget
    from zerohop.engine.sched.step_times import StepTimes

    times = StepTimes()
    times.record(1, 0.2, 1)  # a decode step: over the target
    times.record(64, 6.4, 0)  # a prompt token: 0.1 s, so only a few fit beside decodes
    scheduler = Scheduler(
        BlockPool(64, 4, enable_caching=False),
        16,
        256,
        VTCPolicy(),
        PrefillBudget(0.1, lambda: times),
    )
    background = [seq("bulk", priority=BACKGROUND, n=4) for _ in range(3)]
    for line in background:
        scheduler.add(line)
    scheduled_step(scheduler)
    user = seq("user", n=40)
    scheduler.add(user)
    out = run_step(scheduler)
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(user, 40)]


# --- fair share of a step's prompt budget -----------------------------------------------------


def charged_step(scheduler: Scheduler) -> list[str]:
    """A step as the engine runs it, the policy charged each request's tokens; the ids of the
    requests whose prompt it finished."""
    out = scheduler.schedule()
    scheduler.stepped(out)
    usage, finished = [], []
    for chunk in out.chunks:
        seq, completes = chunk.seq, chunk.completes
        if completes and not seq.num_output_tokens:
            finished.append(seq.request_id)
        seq.num_computed_tokens += chunk.num_tokens
        scheduler.pool.commit(seq)
        if completes:
            seq.token_ids.append(7)
        usage.append(TokenUsage(seq.request_id, seq.tenant, chunk.num_tokens, int(completes)))
    scheduler.policy.charge(usage)
    return finished


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_a_light_tenants_prompt_goes_before_a_floods_running_prompts(policy: str) -> None:
    # 40 tokens a step; the flood's prompts of 400 tokens take many steps each, beside its
    # decodes. A light tenant's 16-token prompt arriving mid-flood is computed in the next
    # step (its counter, lifted to the flood's, wins the tie), not after the flood's running
    # prompt: fair share orders the prompt budget as it orders admission.
    # First come, first served keeps running prompts first.
    from zerohop.engine.sched.policy import FCFSPolicy

    order = VTCPolicy() if policy == "vtc" else FCFSPolicy()
    scheduler = Scheduler(BlockPool(1024, 4, enable_caching=False), 64, 40, order)
    long_answers = SamplingParams(max_tokens=500, ignore_eos=True)
    for i in range(4):
        scheduler.add(Sequence(f"flood-{i}", [1] * 400, long_answers, 500, "flood"))
    while len(scheduler.running) < 2 or not any(s.num_output_tokens for s in scheduler.running):
        charged_step(scheduler)
    light = seq("light", n=16)
    scheduler.add(light)
    steps = 1
    while light.request_id not in charged_step(scheduler):
        steps += 1
    assert steps == 1 if policy == "vtc" else steps > 2, steps
