"""zerohop's scheduler class inside vLLM (zerohop.engine.vllm.scheduler): vLLM's real v1
scheduler, built as vLLM's own tests build one (the tiny model's config read offline, a KV
cache of a few blocks of a one-head spec), driven step by step with a fabricated model output
(every request whose prompt is computed samples one token)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from zerohop.engine.sched.fair_share import BACKGROUND, BATCH, INTERACTIVE, VTCPolicy
from zerohop.engine.vllm.request_tags import RequestTags
from zerohop.engine.vllm.scheduler import (
    BACKGROUND_SHARE_ENV,
    POLICY_ENV,
    TOKEN_WEIGHTS_ENV,
    AsyncFairShareScheduler,
    FairShareScheduler,
    FairShareSettings,
)
from zerohop.models.tiny import tiny_model_dir

Builder = Callable[..., FairShareScheduler]
BLOCK_SIZE = 16
TOKEN = 7  # every sampled token: not the tiny model's EOS
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_config() -> ModelConfig:
    init_none_hash(sha256)
    return ModelConfig(
        model=str(tiny_model_dir()),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=1024,
    )


@pytest.fixture
def build(model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch) -> Builder:
    def make(
        max_num_seqs: int = 4,
        num_blocks: int = 256,
        budget: int = 512,
        share: float = 0.1,
        policy: str = "vtc",
        weights: str = "1,2",
        async_scheduling: bool = False,
    ) -> FairShareScheduler:
        monkeypatch.setenv(BACKGROUND_SHARE_ENV, str(share))
        monkeypatch.setenv(POLICY_ENV, policy)
        monkeypatch.setenv(TOKEN_WEIGHTS_ENV, weights)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            scheduler_cls="zerohop.engine.vllm.scheduler.FairShareScheduler",
        )
        cache_config = CacheConfig(
            block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True
        )
        vllm_config = VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )
        # vLLM's CPU platform turns async scheduling off; a CUDA machine would have it on
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        # as vLLM's EngineCore builds its scheduler: the class by its qualified name
        cls = vllm_config.scheduler_config.get_scheduler_cls()
        scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            include_finished_set=False,
            log_stats=True,
            block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
        )
        assert isinstance(scheduler, FairShareScheduler)
        return scheduler

    return make


def request(
    tenant: str,
    priority: int = INTERACTIVE,
    weight: float = 1.0,
    prompt: int | list[int] = 8,
    max_tokens: int = 4,
    extra_args: dict[str, Any] | None = None,
    **params: Any,
) -> Request:
    tokens = prompt if isinstance(prompt, list) else [next(_ids) % 1000 + 10] * prompt
    tags = RequestTags(tenant, weight, priority).to_extra_args()
    sampling = SamplingParams(
        max_tokens=max_tokens,
        extra_args=tags if extra_args is None else extra_args,
        **params,
    )
    return Request(
        request_id=f"{tenant}-{next(_ids)}",
        prompt_token_ids=tokens,
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def step(scheduler: FairShareScheduler) -> SchedulerOutput:
    """One engine step: schedule, then every request whose prompt is computed samples TOKEN."""
    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in ids:
        req = scheduler.requests[request_id]
        sampled.append([TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
    runner_output = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    scheduler.update_from_output(out, runner_output)
    return out


def admitted(out: SchedulerOutput) -> list[str]:
    return [data.req_id for data in out.scheduled_new_reqs] + sorted(
        out.scheduled_cached_reqs.resumed_req_ids
    )


def counters_of(scheduler: FairShareScheduler) -> dict[str, float]:
    assert isinstance(scheduler.fair_share, VTCPolicy)
    return scheduler.fair_share.counters


def tenant_of(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


def test_the_class_comes_by_name_and_waits_in_zerohops_queue(build: Builder) -> None:
    scheduler = build()
    assert type(scheduler) is FairShareScheduler
    assert scheduler.fair_queue is scheduler.waiting
    assert scheduler.settings == FairShareSettings()


def test_a_light_tenant_goes_before_a_flooding_tenants_queue(build: Builder) -> None:
    scheduler = build(max_num_seqs=2)
    for _ in range(6):
        scheduler.add_request(request("flood", max_tokens=3))
    order = admitted(step(scheduler))
    assert [tenant_of(r) for r in order] == ["flood", "flood"]
    light = request("light", max_tokens=3)
    scheduler.add_request(light)
    # lifted to the flood's counter (it cannot bank the time it was idle), and the tie is its
    while len(order) == 2:
        order += admitted(step(scheduler))
    assert order[2] == light.request_id, "the next free slot is the light tenant's"


def test_fcfs_keeps_arrival_order(build: Builder) -> None:
    scheduler = build(max_num_seqs=2, policy="fcfs")
    for _ in range(4):
        scheduler.add_request(request("flood", max_tokens=3))
    light = request("light", max_tokens=3)
    scheduler.add_request(light)
    order: list[str] = []
    for _ in range(20):
        order += admitted(step(scheduler))
    assert order.index(light.request_id) == 4


def test_a_weight_2_tenant_gets_about_twice_the_admissions(build: Builder) -> None:
    scheduler = build(max_num_seqs=3)
    for _ in range(40):
        scheduler.add_request(request("heavy", weight=2.0, max_tokens=2))
        scheduler.add_request(request("plain", max_tokens=2))
    order: list[str] = []
    for _ in range(30):
        order += admitted(step(scheduler))
    counts = Counter(tenant_of(r) for r in order)
    assert counts["heavy"] + counts["plain"] >= 30
    assert 1.7 <= counts["heavy"] / counts["plain"] <= 2.3, counts


def test_counters_charge_input_at_admission_and_output_per_token(build: Builder) -> None:
    scheduler = build(weights="1,2")
    one = request("a", prompt=10, max_tokens=3)
    two = request("b", weight=2.0, prompt=10, max_tokens=3)
    scheduler.add_request(one)
    scheduler.add_request(two)
    step(scheduler)
    counters = counters_of(scheduler)
    # admitted: 10 prompt tokens times 1; the prompt step sampled a token, times 2
    assert counters == {"a": 12.0, "b": 6.0}
    for _ in range(4):
        step(scheduler)
    assert counters == {"a": 16.0, "b": 8.0}
    assert one.is_finished() and two.is_finished()


def test_a_chunked_prompt_is_charged_once(build: Builder) -> None:
    scheduler = build(budget=32, weights="1,0")
    long = request("a", prompt=100, max_tokens=2)
    scheduler.add_request(long)
    chunks = [step(scheduler).num_scheduled_tokens[long.request_id] for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert counters_of(scheduler)["a"] == 100.0


def test_interactive_before_batch_before_background(build: Builder) -> None:
    scheduler = build(max_num_seqs=1, share=1.0)
    background = request("c", priority=BACKGROUND, max_tokens=1)
    batch = request("b", priority=BATCH, max_tokens=1)
    interactive = request("a", priority=INTERACTIVE, max_tokens=1)
    for req in (background, batch, interactive):
        scheduler.add_request(req)
    order: list[str] = []
    for _ in range(6):
        order += admitted(step(scheduler))
    assert order == [interactive.request_id, batch.request_id, background.request_id]


def test_background_runs_within_its_share_beside_interactive_work(build: Builder) -> None:
    scheduler = build(max_num_seqs=10, share=0.2)  # 2 of 10 slots
    lines = [request("batch", priority=BACKGROUND, max_tokens=50) for _ in range(6)]
    for line in lines:
        scheduler.add_request(line)
    out = step(scheduler)
    assert len(admitted(out)) == 6, "alone, background work takes what it can"

    chat = request("chat", max_tokens=5)
    scheduler.add_request(chat)
    for _ in range(5):
        out = step(scheduler)
        scheduled = set(out.num_scheduled_tokens)
        assert chat.request_id in scheduled
        background = [r for r in scheduled if tenant_of(r) == "batch"]
        assert len(background) == 2, "beside interactive work, at most its share"
        assert all(line.status == RequestStatus.RUNNING for line in lines), "they keep blocks"
    assert chat.is_finished()
    out = step(scheduler)
    assert len(out.num_scheduled_tokens) == 6, "then background work has the steps again"


def test_background_is_not_admitted_past_its_share(build: Builder) -> None:
    scheduler = build(max_num_seqs=10, share=0.2)
    chat = request("chat", max_tokens=20)
    scheduler.add_request(chat)
    for _ in range(5):
        scheduler.add_request(request("batch", priority=BACKGROUND, max_tokens=20))
    out = step(scheduler)
    assert [tenant_of(r) for r in admitted(out)] == ["chat", "batch", "batch"]
    for _ in range(3):
        assert admitted(step(scheduler)) == []
    assert len(scheduler.waiting) == 3


def test_interactive_work_takes_a_slot_from_background_work(build: Builder) -> None:
    scheduler = build(max_num_seqs=3, share=0.5)
    lines = [request("batch", priority=BACKGROUND, max_tokens=50) for _ in range(3)]
    for line in lines:
        scheduler.add_request(line)
    step(scheduler)
    chat = request("chat", max_tokens=3)
    scheduler.add_request(chat)
    out = step(scheduler)
    assert admitted(out) == [chat.request_id], "every slot was taken: a line yields one"
    assert out.preempted_req_ids == {lines[-1].request_id}, "the newest line"
    assert lines[-1].status == RequestStatus.PREEMPTED
    back: list[str] = []
    for _ in range(4):
        back += admitted(step(scheduler))
    assert chat.is_finished()
    assert back == [lines[-1].request_id], "it comes back once the interactive work is done"


def test_out_of_blocks_preempts_background_work_first(build: Builder) -> None:
    # 8 blocks of 16 tokens; two requests of 3 blocks each grow until the cache is full
    scheduler = build(max_num_seqs=4, num_blocks=8, share=1.0)
    line = request("batch", priority=BACKGROUND, prompt=40, max_tokens=200)
    scheduler.add_request(line)
    step(scheduler)
    chat = request("chat", prompt=40, max_tokens=200)  # newer: vLLM's default victim
    scheduler.add_request(chat)
    preempted: set[str] = set()
    for _ in range(40):
        preempted |= step(scheduler).preempted_req_ids or set()
        if preempted:
            break
    assert preempted == {line.request_id}
    assert chat.status == RequestStatus.RUNNING


def test_out_of_blocks_preempts_the_most_served_tenant_first(build: Builder) -> None:
    # 8 blocks of 16 tokens; three requests of 24 tokens grow until the cache is full
    scheduler = build(max_num_seqs=4, num_blocks=8)
    heavy = [request("heavy", prompt=24, max_tokens=200) for _ in range(2)]
    for req in heavy:
        scheduler.add_request(req)
    step(scheduler)
    light = request("light", weight=4.0, prompt=24, max_tokens=200)  # newest, served least
    scheduler.add_request(light)
    preempted: set[str] = set()
    for _ in range(40):
        preempted |= step(scheduler).preempted_req_ids or set()
        if preempted:
            break
    counters = counters_of(scheduler)
    assert counters["heavy"] > counters["light"]
    assert preempted == {heavy[1].request_id}, "the most-served tenant's newest request"
    assert light.status == RequestStatus.RUNNING


def test_aborting_a_waiting_request_removes_it(build: Builder) -> None:
    scheduler = build(max_num_seqs=1)
    first, second, third = (request("a", max_tokens=2) for _ in range(3))
    for req in (first, second, third):
        scheduler.add_request(req)
    step(scheduler)
    scheduler.finish_requests(second.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(scheduler.waiting) == 1
    assert second not in list(scheduler.waiting)
    order: list[str] = []
    for _ in range(6):
        order += admitted(step(scheduler))
    assert order == [third.request_id]
    assert second.request_id not in scheduler.requests
    assert len(scheduler.waiting) == 0


def test_a_tenant_that_comes_back_is_lifted(build: Builder) -> None:
    scheduler = build(max_num_seqs=1)
    scheduler.add_request(request("a", max_tokens=3))
    for _ in range(4):
        step(scheduler)
    counters = counters_of(scheduler)
    assert counters["a"] == 8 + 3 * 2
    # nobody waits: a new tenant starts from the last admitted tenant's counter
    scheduler.add_request(request("b", max_tokens=3))
    assert counters["b"] == counters["a"] == 14
    for _ in range(4):
        step(scheduler)
    assert counters["b"] == 14 + 8 + 3 * 2
    # a comes back (it did not bank its idle time): lifted to b's, the last admitted
    scheduler.add_request(request("a", max_tokens=3))
    scheduler.add_request(request("a", max_tokens=3))
    assert counters["a"] == 28
    step(scheduler)
    assert counters["a"] == 28 + 8 + 2
    # b comes back while a waits: lifted to the smallest backlogged counter, and the tie is b's
    back = request("b", max_tokens=3)
    scheduler.add_request(back)
    assert counters["b"] == counters["a"] == 38
    order: list[str] = []
    while not order:
        order = admitted(step(scheduler))
    assert order == [back.request_id]


def test_prefix_caching_still_serves_a_shared_prompt(build: Builder) -> None:
    scheduler = build()
    prompt = list(range(100, 148))  # three full blocks
    first = request("a", prompt=prompt, max_tokens=2)
    scheduler.add_request(first)
    for _ in range(3):
        step(scheduler)
    assert first.is_finished()
    second = request("b", prompt=[*prompt, 1, 2], max_tokens=2)
    scheduler.add_request(second)
    out = step(scheduler)
    assert out.num_scheduled_tokens[second.request_id] == 2, "48 tokens came from the cache"


def test_a_request_waiting_for_its_grammar_is_held_out_of_the_order(build: Builder) -> None:
    scheduler = build(max_num_seqs=2)
    constrained = request("a", structured_outputs=StructuredOutputsParams(choice=["x", "y"]))
    assert constrained.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    grammar: Future = Future()
    assert constrained.structured_output_request is not None
    constrained.structured_output_request.grammar = grammar  # compiling
    other = request("b", max_tokens=2)
    scheduler.add_request(constrained)
    scheduler.add_request(other)
    assert len(scheduler.waiting) == 2
    assert admitted(step(scheduler)) == [other.request_id], "it does not hold the line"
    assert "a" not in counters_of(scheduler), "not backlogged while it compiles"
    grammar.set_exception(ValueError("no grammar"))  # a failed compile: vLLM ends it
    step(scheduler)
    assert constrained.status == RequestStatus.FINISHED_ERROR
    assert len(scheduler.waiting) == 0


def test_tags_that_cannot_be_scheduled_end_that_request_only(build: Builder) -> None:
    scheduler = build()
    bad = request("x", extra_args={"zerohop": {"tenant": "x", "weight": -1, "class": 0}})
    good = request("a", max_tokens=2)
    scheduler.add_request(bad)
    scheduler.add_request(good)
    out = scheduler.schedule()
    assert admitted(out) == [good.request_id]
    ids = list(out.num_scheduled_tokens)
    outputs = scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[TOKEN]],
        ),
    )
    finished = {o.request_id: o.finish_reason for o in outputs[0].outputs}
    assert bad.status == RequestStatus.FINISHED_ERROR
    assert finished[bad.request_id] is not None
    assert len(scheduler.waiting) == 0


def test_untagged_requests_are_the_default_tenants(build: Builder) -> None:
    scheduler = build()
    scheduler.add_request(request("x", extra_args={}))
    step(scheduler)
    assert set(counters_of(scheduler)) == {"default"}


def test_with_async_scheduling_the_name_builds_the_async_variant(build: Builder) -> None:
    scheduler = build(async_scheduling=True, max_num_seqs=1)
    assert isinstance(scheduler, AsyncFairShareScheduler)
    flood = [request("flood", max_tokens=2) for _ in range(3)]
    for req in flood:
        scheduler.add_request(req)
    light = request("light", max_tokens=2)
    scheduler.add_request(light)
    order: list[str] = []
    for _ in range(12):
        order += admitted(step(scheduler))
    assert order[0] == light.request_id
    assert all(req.is_finished() for req in [*flood, light])


def test_settings_from_the_environment() -> None:
    assert FairShareSettings.from_env({}) == FairShareSettings("vtc", (1.0, 2.0), 0.1)
    settings = FairShareSettings("fcfs", (1.0, 3.0), 0.25)
    assert FairShareSettings.from_env(settings.to_env()) == settings
    for env, name in (
        ({POLICY_ENV: "lottery"}, POLICY_ENV),
        ({TOKEN_WEIGHTS_ENV: "1"}, TOKEN_WEIGHTS_ENV),
        ({TOKEN_WEIGHTS_ENV: "0,0"}, TOKEN_WEIGHTS_ENV),
        ({BACKGROUND_SHARE_ENV: "-1"}, BACKGROUND_SHARE_ENV),
        ({BACKGROUND_SHARE_ENV: "many"}, BACKGROUND_SHARE_ENV),
    ):
        with pytest.raises(ValueError, match=name):
            FairShareSettings.from_env(env)
    assert FairShareSettings(background_share=0.1).background_cap(8) == 1
    assert FairShareSettings(background_share=0.25).background_cap(8) == 2
    assert FairShareSettings(background_share=0).background_cap(8) == 0
