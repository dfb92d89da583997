"""Engine behaviour beyond greedy equality: sampling, logprobs, stops, aborts, leaks, faults,
and the errors a bad model folder raises."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from tests.fixtures import drive_engine
from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE, hf_greedy, load_hf_model
from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import InvalidRequestError, ModelLoadError
from zerohop.engine.sched.fair_share import VTCPolicy
from zerohop.engine.sched.policy import FCFSPolicy

NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=NUM_BLOCKS, max_num_seqs=16)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(length - 1)]


def greedy(max_tokens: int = 12, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def sampled(seed: int | None, max_tokens: int = 16, **extra) -> SamplingParams:
    extra.setdefault("temperature", 1.0)
    return SamplingParams(seed=seed, max_tokens=max_tokens, ignore_eos=True, **extra)


PROMPT = random_prompt(random.Random(10), 12)


# --- sampling -------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    alone = llm.generate([PROMPT], sampled(42))[0].token_ids
    assert llm.generate([PROMPT], sampled(42))[0].token_ids == alone
    assert llm.generate([PROMPT], sampled(43))[0].token_ids != alone

    rng = random.Random(11)
    others = [random_prompt(rng, n) for n in (5, 30)]
    outs = llm.generate([others[0], PROMPT, others[1]], [sampled(7), sampled(42), greedy()])
    assert outs[1].token_ids == alone, "a seeded request must not depend on its batch"

    # Joining a batch that is already decoding, and unseeded neighbours drawing too.
    arrivals = {
        0: [("a", others[0], sampled(None)), ("b", others[1], sampled(None, max_tokens=30))],
        4: [("seeded", PROMPT, sampled(42))],
    }
    runs, _ = drive_engine(llm.engine, arrivals)
    assert runs["seeded"].token_ids == alone


def test_sampling_actually_samples(llm: LLM) -> None:
    draws = {tuple(llm.generate([PROMPT], sampled(seed))[0].token_ids) for seed in range(4)}
    assert len(draws) == 4
    assert tuple(llm.generate([PROMPT], greedy(16))[0].token_ids) not in draws


def test_top_k_one_and_tiny_top_p_equal_greedy(llm: LLM) -> None:
    want = llm.generate([PROMPT], greedy(16))[0].token_ids
    assert llm.generate([PROMPT], sampled(1, top_k=1))[0].token_ids == want
    assert llm.generate([PROMPT], sampled(2, top_p=1e-6))[0].token_ids == want
    assert llm.generate([PROMPT], sampled(3, top_k=1, temperature=5.0))[0].token_ids == want


# --- logprobs -------------------------------------------------------------------------


def test_logprobs_match_transformers(llm: LLM, llama_dir: Path) -> None:
    n = 5
    out = llm.generate([PROMPT], greedy(8, logprobs=n))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
    model = load_hf_model(llama_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, (token, entries) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert len(entries) == n
        values = list(entries.values())
        assert values == sorted(values, reverse=True), "entries come most likely first"
        assert all(v <= 0 for v in values)
        assert token in entries and entries[token] == max(values), "greedy chose the top one"
        row = reference[len(PROMPT) - 1 + i]
        top = row.topk(n)
        assert list(entries) == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-4)


def test_logprobs_of_sampled_tokens(llm: LLM) -> None:
    out = llm.generate([PROMPT], sampled(5, temperature=1.5, logprobs=2, max_tokens=20))[0]
    assert out.logprobs is not None and len(out.logprobs) == 20
    for token, entries in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entries, "the chosen token's logprob is always returned"
        assert len(entries) in (2, 3)  # top 2, plus the chosen one when it is not among them
        assert all(v <= 0 for v in entries.values())
    zero = llm.generate([PROMPT], greedy(4, logprobs=0))[0]
    assert [list(e) for e in zero.logprobs] == [[t] for t in zero.token_ids]
    assert llm.generate([PROMPT], greedy(4))[0].logprobs is None


# --- stopping -------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = llm.generate([PROMPT], greedy(7))[0]
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("length", None, 7)


def test_stop_token_ids(llm: LLM) -> None:
    full = llm.generate([PROMPT], greedy(12))[0].token_ids
    i = next(i for i in range(3, len(full)) if full.index(full[i]) == i)
    out = llm.generate([PROMPT], greedy(12, stop_token_ids=[full[i]]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == full[i]
    assert out.token_ids == full[: i + 1], "the stop token is the last output token"


def test_eos_from_generation_config_stops_unless_ignored(llama_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(llama_dir, tmp_path)
    full = LLM(str(folder), num_kv_blocks=32).generate([PROMPT], greedy(12))[0].token_ids
    eos = {1, 3}  # the toy tokenizer's </s> and <|im_end|>
    i = next(i for i in range(2, len(full)) if full.index(full[i]) == i and full[i] not in eos)
    assert not eos & set(full[:i])
    edit_json(folder / "generation_config.json", eos_token_id=[full[i]])
    llm = LLM(str(folder), num_kv_blocks=32)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: i + 1]
    assert llm.generate([PROMPT], greedy(12))[0].token_ids == full


def test_stop_string_across_token_boundary(llm: LLM, llama_dir: Path) -> None:
    prompt = llm.tokenizer.encode("Hello, world! The quick brown fox")
    full = llm.generate([prompt], greedy(40))[0]
    decoder = HFTokenizer.from_file(str(llama_dir / "tokenizer.json"))
    reference = decoder.decode(full.token_ids, skip_special_tokens=True)
    assert full.text == reference.rstrip("\ufffd") or full.text == reference
    stop, start, last_token = find_straddling_stop(decoder, full.token_ids, full.text)

    params = greedy(40, stop=[stop])
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:start], "output ends right before the stop string"
    assert out.token_ids == full.token_ids[: last_token + 1]

    # Streamed: no piece of the stop string is ever emitted, even before it is complete.
    runs, _ = drive_engine(llm.engine, {0: [("s", prompt, params)]})
    assert runs["s"].text == full.text[:start] and runs["s"].finish_reason == "stop"


def find_straddling_stop(decoder: HFTokenizer, ids: list[int], text: str) -> tuple[str, int, int]:
    """A 4-character stop string made of 2 characters from each side of a token boundary,
    first occurring there. Returns it, its offset in `text`, and the index of the token
    that completes it."""
    prefixes = [decoder.decode(ids[:j], skip_special_tokens=True) for j in range(len(ids) + 1)]
    for j in range(1, len(ids)):
        boundary = len(prefixes[j])
        if boundary < 2 or not text.startswith(prefixes[j]) or "\ufffd" in prefixes[j]:
            continue
        stop = text[boundary - 2 : boundary + 2]
        if len(stop) == 4 and "\ufffd" not in stop and text.find(stop) == boundary - 2:
            completing = next(k for k in range(j, len(ids)) if len(prefixes[k + 1]) >= boundary + 2)
            return stop, boundary - 2, completing
    raise AssertionError(f"no stop string straddles a token boundary in {text!r}")


# --- aborts and block accounting ------------------------------------------------------


def test_abort_frees_blocks_at_next_step(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("long", random_prompt(random.Random(12), 40), greedy(500))
    engine.add_request("never-scheduled", PROMPT, greedy(5))
    engine.abort("never-scheduled")
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks_in_use > 0
    engine.abort("long")
    for delta in engine.step():
        assert delta.request_id == "long" and delta.finished and delta.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.stats().blocks_in_use == 0
    engine.abort("long")  # aborting a finished or unknown request is harmless
    engine.abort("no-such-request")


def test_no_block_leaks_after_1000_random_requests(llama_dir: Path) -> None:
    num_blocks, block_size = 24, 16
    llm = LLM(
        str(llama_dir),
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    engine = llm.engine
    rng = random.Random(13)
    prefixes = [random_prompt(rng, 20) for _ in range(3)]  # shared, so the prefix cache works
    active: set[str] = set()
    finished: dict[str, str] = {}
    submitted = steps = 0
    while submitted < 1000 or engine.has_unfinished():
        for _ in range(min(rng.choice((0, 0, 1, 1, 2, 3)), 1000 - submitted)):
            request_id = f"r{submitted}"
            prompt = rng.choice(prefixes)[: rng.randint(1, 20)]
            prompt += random_prompt(rng, rng.randint(1, 20))[1:]
            params = random_params(rng)
            engine.add_request(request_id, prompt, params)
            active.add(request_id)
            submitted += 1
        if active and rng.random() < 0.1:
            victim = rng.choice(sorted(active))
            engine.abort(victim)
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason
                active.discard(delta.request_id)
        steps += 1
        assert steps < 20_000, "the engine stopped making progress"
    assert sorted(finished) == sorted(f"r{i}" for i in range(1000)) and not active
    assert set(finished.values()) <= {"length", "abort"}
    stats = engine.stats()
    assert stats.num_blocks == num_blocks and stats.blocks_in_use == 0
    # Cached blocks are free (evictable) once no request holds them.
    assert stats.blocks_free == num_blocks and stats.blocks_cached <= stats.blocks_free
    assert not any(engine.pool.ref_counts), "a block is still referenced"
    # Every block is reusable: a request that needs the whole pool still runs.
    whole_pool = random_prompt(rng, (num_blocks - 1) * block_size)
    out = llm.generate([whole_pool], greedy(block_size))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == block_size
    assert engine.stats().blocks_in_use == 0


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 6)
    if rng.random() < 0.5:
        return greedy(max_tokens)
    return sampled(rng.randrange(1000), max_tokens, temperature=rng.choice((0.5, 1.0)))


# --- fault isolation ------------------------------------------------------------------


def test_nan_logits_fail_only_their_request(llama_dir: Path, monkeypatch) -> None:
    from zerohop.engine.runner import ModelRunner

    execute = ModelRunner.execute

    def poisoned(self, chunks):
        rows = [c.seq.request_id for c in chunks if c.completes]
        logits = execute(self, chunks)
        with torch.inference_mode():  # the runner returns an inference tensor
            for row, request_id in enumerate(rows):
                if request_id == "bad":
                    logits[row] = float("nan")
        return logits

    monkeypatch.setattr(ModelRunner, "execute", poisoned)
    run_with_one_faulty_request(llama_dir, greedy(10), ("finite", "nan"))


def test_sampler_exception_fails_only_its_request(llama_dir: Path, monkeypatch) -> None:
    from zerohop.engine.sample.sampler import Sampler

    sample_row = Sampler._sample_row

    def faulty(row, p, gen):
        if p.seed == 666:
            raise RuntimeError("injected sampler fault")
        return sample_row(row, p, gen)

    monkeypatch.setattr(Sampler, "_sample_row", staticmethod(faulty))
    # The client is told sampling failed; the exception's own text stays in the log.
    run_with_one_faulty_request(llama_dir, sampled(666, max_tokens=10), ("sampling",))


def run_with_one_faulty_request(folder: Path, bad: SamplingParams, words: tuple[str, ...]):
    llm = LLM(str(folder), num_kv_blocks=64, max_num_seqs=8)
    rng = random.Random(14)
    prompts = {name: random_prompt(rng, n) for name, n in (("a", 9), ("b", 30), ("c", 3))}
    arrivals = {
        0: [("a", prompts["a"], greedy(10)), ("bad", PROMPT, bad)],
        2: [("b", prompts["b"], greedy(10)), ("c", prompts["c"], sampled(9, max_tokens=10))],
    }
    runs, _ = drive_engine(llm.engine, arrivals)
    failed = runs["bad"]
    assert failed.finished and failed.finish_reason == "error"
    assert failed.error and any(w in failed.error.lower() for w in words), failed.error
    for name in ("a", "b"):
        assert runs[name].finish_reason == "length" and runs[name].error is None
        assert runs[name].token_ids == hf_greedy(folder, prompts[name], 10)
    assert runs["c"].finish_reason == "length" and len(runs["c"].token_ids) == 10
    assert llm.engine.stats().blocks_in_use == 0
    # The engine goes on serving.
    again = llm.generate([prompts["a"]], greedy(10))[0]
    assert again.token_ids == runs["a"].token_ids


class FaultyPolicy(VTCPolicy):
    """Fair share, but `hook` raises whenever it is about the tenant "evil"."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        self.hook = hook

    def _maybe_raise(self, hook: str, tenants: set[str]) -> None:
        if hook == self.hook and "evil" in tenants:
            raise RuntimeError(f"injected {hook} fault")

    def add(self, seq) -> None:
        self._maybe_raise("add", {seq.tenant})
        super().add(seq)

    def admitted(self, seq) -> None:
        self._maybe_raise("admitted", {seq.tenant})
        super().admitted(seq)

    def requeue(self, seq) -> None:
        self._maybe_raise("requeue", {seq.tenant})
        super().requeue(seq)

    def charge(self, usage) -> None:
        self._maybe_raise("charge", {u.tenant for u in usage})
        super().charge(usage)


# `requeue` needs a preemption: 6 blocks of 16 tokens for three requests that grow to 4-5.
HOOK_OPTIONS = {"num_kv_blocks": 6, "max_num_seqs": 4, "block_size": 16}


@pytest.mark.parametrize("hook", ["add", "admitted", "charge", "requeue"])
def test_a_policy_hook_failing_for_one_request_fails_only_that_request(
    llama_dir: Path, hook: str
) -> None:
    rng = random.Random(15)
    prompts = {name: random_prompt(rng, n) for name, n in (("a", 20), ("b", 33), ("evil", 30))}
    options = HOOK_OPTIONS if hook == "requeue" else {"num_kv_blocks": 64, "max_num_seqs": 8}
    params = greedy(40)
    clean = LLM(str(llama_dir), **options)
    expected = {name: clean.generate([p], params)[0].token_ids for name, p in prompts.items()}
    llm = LLM(str(llama_dir), policy=FaultyPolicy(hook), **options)
    arrivals = {
        0: [("a", prompts["a"], params, {"tenant": "t1"})],
        1: [("evil", prompts["evil"], params, {"tenant": "evil"})],
        2: [("b", prompts["b"], params, {"tenant": "t2"})],
    }
    runs, _ = drive_engine(llm.engine, arrivals)
    failed = runs["evil"]
    assert failed.finished and failed.finish_reason == "error", failed
    assert failed.error == "the scheduling policy failed on this request"
    for name in ("a", "b"):
        assert runs[name].finish_reason == "length" and runs[name].error is None
        assert runs[name].token_ids == expected[name]
    assert llm.engine.stats().blocks_in_use == 0
    again = llm.generate([prompts["a"]], params)[0]  # the engine goes on serving
    assert again.token_ids == expected["a"]


class QueueFaultPolicy(FCFSPolicy):
    """`peek` (a hook about the whole queue) raises while `broken`."""

    broken = False

    def peek(self):
        if self.broken:
            raise RuntimeError("injected peek fault")
        return super().peek()


def test_a_step_that_fails_as_a_whole_fails_its_requests_and_the_engine_goes_on(
    llama_dir: Path,
) -> None:
    from zerohop.engine.step import MAX_FAILED_STEPS, EngineBrokenError

    policy = QueueFaultPolicy()
    llm = LLM(str(llama_dir), policy=policy, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    engine.add_request("running", PROMPT, greedy(50))
    engine.step()
    engine.add_request("waiting", PROMPT[:5], greedy(5))
    policy.broken = True
    deltas = {d.request_id: d for d in engine.step()}
    assert set(deltas) == {"running", "waiting"}
    assert all(d.finished and d.finish_reason == "error" for d in deltas.values())
    assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0
    policy.broken = False
    assert llm.generate([PROMPT], greedy(5))[0].finish_reason == "length"
    # A step failing again and again is a broken engine: it says so (its process exits).
    policy.broken = True
    with pytest.raises(EngineBrokenError):
        for i in range(MAX_FAILED_STEPS):
            engine.add_request(f"doomed-{i}", PROMPT, greedy(5))
            engine.step()


@pytest.mark.parametrize(
    ("option", "value"),
    [("weight", 0), ("weight", -1.0), ("weight", float("nan")), ("weight", float("inf")),
     ("weight", "2"), ("priority", -1), ("priority", 0.5), ("tenant", None)],
)  # fmt: skip
def test_bad_scheduling_options_are_refused_at_add_time(llm: LLM, option: str, value) -> None:
    with pytest.raises(InvalidRequestError, match=option):
        llm.engine.add_request("bad", PROMPT, greedy(5), **{option: value})
    assert not llm.engine.has_unfinished()
    assert llm.generate([PROMPT], greedy(5))[0].finish_reason == "length"


def test_a_continuation_must_end_the_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="continues"):
        llm.engine.add_request("bad", PROMPT, greedy(5), continues=[PROMPT[0], 99])


# --- model folders we cannot load -----------------------------------------------------


def copy_model(source: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    return folder


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def remove_tensor(folder: Path, name: str) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


BROKEN_FOLDERS = {
    "no-config": (lambda f: (f / "config.json").unlink(), "config.json"),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "safetensors"),
    "no-tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json"),
    "bad-json": (lambda f: (f / "config.json").write_text("{not json"), "config.json"),
    "architecture": (
        lambda f: edit_json(f / "config.json", architectures=["GPT2LMHeadModel"]),
        "GPT2LMHeadModel",
    ),
    "hidden_act": (lambda f: edit_json(f / "config.json", hidden_act="gelu"), "hidden_act"),
    "mlp_bias": (lambda f: edit_json(f / "config.json", mlp_bias=True), "mlp_bias"),
    "sliding_window": (
        lambda f: edit_json(f / "config.json", sliding_window=64),
        "sliding_window",
    ),
    "rope_type": (
        lambda f: edit_json(
            f / "config.json",
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4},
        ),
        "dynamic",
    ),
    "missing-field": (
        lambda f: edit_json(f / "config.json", hidden_size=None),
        "hidden_size",
    ),
    "missing-tensor": (
        lambda f: remove_tensor(f, "model.layers.1.mlp.down_proj.weight"),
        "model.layers.1.mlp.down_proj.weight",
    ),
    # config.json disagrees with the weights (2 KV heads in the file).
    "wrong-shape": (
        lambda f: edit_json(f / "config.json", num_key_value_heads=4),
        "k_proj",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_FOLDERS))
def test_bad_model_folder_raises_model_load_error(
    case: str, llama_dir: Path, tmp_path: Path
) -> None:
    breaker, named = BROKEN_FOLDERS[case]
    folder = copy_model(llama_dir, tmp_path)
    breaker(folder)
    with pytest.raises(ModelLoadError) as caught:
        LLM(str(folder), num_kv_blocks=8)
    assert named in str(caught.value), f"the error should name {named!r}: {caught.value}"


def test_tiny_temperature_is_greedy(llama_dir) -> None:
    from zerohop import LLM, SamplingParams

    llm = LLM(llama_dir, num_kv_blocks=32)
    prompt = list(range(5, 25))
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tiny = llm.generate([prompt], SamplingParams(temperature=1e-300, max_tokens=8, ignore_eos=True))
    assert tiny[0].error is None and tiny[0].token_ids == greedy[0].token_ids
