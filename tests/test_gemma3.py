"""Gemma 3 text models (Gemma3ForCausalLM, GGUF `gemma3`) against transformers on the same
random weights: local sliding-window layers (window 8, so 40-token prompts run far past it)
between global ones, each with its own RoPE base, q/k norms, four (1 + w) norms a layer, the
embedding scale and the query_pre_attn_scalar scale. Greedy ids identical at float32 on the
C++ kernels and on plain torch ops, from the folder and from a GGUF file written as llama.cpp's
converter writes it (norm weights stored as w + 1); logits the same alone, batched, chunked
and cached past the window; soft-capping refused by field.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as VT
from transformers import AutoTokenizer

from tests.fixtures.engine_runs import staggered
from tests.fixtures.tiny_gguf import gguf_contents, write_contents, write_gguf
from tests.fixtures.tiny_models import BOS_ID, VOCAB_SIZE, build_tiny_model, hf_greedy
from zerohop import LLM, SamplingParams
from zerohop.engine import kernels
from zerohop.engine.base.errors import ModelLoadError

MAX_NEW = 8
ENGINE: dict[str, Any] = {"num_kv_blocks": 64, "max_num_batched_tokens": 256}
WINDOW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gemma3") / "gemma3", "gemma3")


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # As llama.cpp reads a gemma3 file: the query scale from the head size (no key holds
    # Gemma's scalar), every 6th layer global (no key holds the layer types). Heads of 64:
    # the prompt kernel's tiles run where a chunk's rows all lie within the window.
    root = tmp_path_factory.mktemp("gemma3_gguf")
    shape = {"head_dim": 64, "query_pre_attn_scalar": 64, "num_hidden_layers": 6}
    shape["layer_types"] = None
    return build_tiny_model(root / "gemma3", "gemma3", **shape)


@pytest.fixture(scope="module")
def gguf_file(gguf_folder: Path) -> Path:
    return write_gguf(gguf_folder, gguf_folder.parent / "gemma3.gguf", "F32")


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(n - 1)] for n in lengths]


def greedy(logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)


def assert_greedy_matches(path: Path, reference: Path, lengths: tuple[int, ...]) -> LLM:
    llm = LLM(str(path), quantization="none", **ENGINE)
    batch = prompts(len(lengths), lengths)
    for prompt, out in zip(batch, llm.generate(batch, greedy()), strict=True):
        assert out.token_ids == hf_greedy(reference, prompt, MAX_NEW), f"{len(prompt)} tokens"
    return llm


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch"])
def test_folder_greedy_matches_transformers_past_the_window(
    folder: Path, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    llm = assert_greedy_matches(folder, folder, (5, 40))
    model = llm.engine.model
    assert [layer.window for layer in model.layers] == [WINDOW, 0, WINDOW]
    assert model.scale == 24**-0.5
    # q/k norms keep Gemma off the C++ decode step: the Python fused pass runs it.
    assert llm.engine.runner.decode_step is None


def test_a_config_in_the_released_checkpoints_layout_loads(folder: Path, tmp_path: Path) -> None:
    # Gemma 3's released config.json: rope_theta, rope_local_base_freq and rope_scaling at the
    # top level, layers by sliding_window_pattern; transformers' class defaults left out.
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    config = json.loads((legacy / "config.json").read_text())
    del config["rope_parameters"]
    del config["layer_types"], config["tie_word_embeddings"], config["hidden_activation"]
    config["sliding_window_pattern"] = 2  # local, global, local
    config["rope_theta"] = 2e5
    config["rope_local_base_freq"] = 500.0  # not the default 10000
    config["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    (legacy / "config.json").write_text(json.dumps(config))
    llm = assert_greedy_matches(legacy, legacy, (40,))
    assert llm.engine.model.config.gemma3.local_theta == 500.0  # type: ignore[union-attr]
    assert [layer.window for layer in llm.engine.model.layers] == [WINDOW, 0, WINDOW]


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch"])
def test_gguf_greedy_matches_transformers(
    gguf_folder: Path, gguf_file: Path, with_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not with_kernels:
        monkeypatch.setattr(kernels, "available", lambda: False)
    llm = assert_greedy_matches(gguf_file, gguf_folder, (6, 40))
    assert [layer.window for layer in llm.engine.model.layers] == [WINDOW] * 5 + [0]


def flatten(deltas: list[Any]) -> tuple[list[int], list[Any]]:
    tokens: list[int] = []
    logprobs: list[Any] = []
    for new_ids, new_logprobs in deltas:
        tokens += new_ids
        logprobs += new_logprobs or []
    return tokens, logprobs


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_alone_batched_chunked_and_cached_give_the_same_logits(
    gguf_folder: Path, gguf_file: Path, qtype: str
) -> None:
    rng = random.Random(5)
    shared = [rng.randrange(4, VOCAB_SIZE) for _ in range(32)]  # whole blocks to cache
    batch = [
        [BOS_ID, *(shared if i % 2 == 0 else []), *prompts(i, (rng.randrange(3, 30),))[0][1:]]
        for i in range(8)
    ]
    params, path = greedy(logprobs=5), str(gguf_file)
    if qtype != "F32":
        path = str(write_gguf(gguf_folder, gguf_folder.parent / f"gemma3-{qtype}.gguf", qtype))

    def results(outs: list[Any]) -> list[tuple[list[int], list[Any]]]:
        return [(out.token_ids, out.logprobs) for out in outs]

    alone = LLM(path, **ENGINE, enable_prefix_caching=False)
    want = [results(alone.generate([p], params))[0] for p in batch]
    together = LLM(path, **ENGINE)
    assert results(together.generate(batch, params)) == want
    assert results(together.generate(batch, params)) == want  # from the prefix cache
    chunked = LLM(path, **ENGINE | {"max_num_batched_tokens": 12})
    assert [flatten(d) for d in staggered(chunked, batch, params)] == want


@pytest.mark.parametrize("name", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_soft_capping_is_refused_by_field(folder: Path, tmp_path: Path, name: str) -> None:
    copy = tmp_path / "capped"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config[name] = 30.0
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config\.json: field '{name}'"):
        LLM(str(copy), **ENGINE)


def test_a_gguf_file_with_soft_capping_is_refused(gguf_folder: Path, tmp_path: Path) -> None:
    contents = gguf_contents(gguf_folder, "F32")
    contents.put("gemma3.final_logit_softcapping", 30.0, VT.FLOAT32)
    path = write_contents(contents, tmp_path / "capped.gguf")
    with pytest.raises(ModelLoadError, match=r"capped\.gguf.*'gemma3\.final_logit_softcapping'"):
        LLM(str(path), **ENGINE)


# Gemma 3's chat template (as its tokenizer_config.json ships it, images left out): no system
# role, so a system message is folded into the first user turn; the assistant is "model".
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
]
WANT = (
    "<s><start_of_turn>user\nAnswer briefly.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
)


def test_gemma_chat_template_from_the_folder_and_the_file(
    gguf_folder: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "chat"
    shutil.copytree(gguf_folder, folder)
    (folder / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    reference = AutoTokenizer.from_pretrained(folder)
    assert reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == WANT
    assert LLM(str(folder), **ENGINE).engine.tokenizer.apply_chat_template(CHAT) == WANT
    contents = gguf_contents(gguf_folder, "F32")
    contents.put("tokenizer.chat_template", GEMMA_TEMPLATE, VT.STRING)
    path = write_contents(contents, tmp_path / "chat.gguf")
    assert LLM(str(path), **ENGINE).engine.tokenizer.apply_chat_template(CHAT) == WANT
