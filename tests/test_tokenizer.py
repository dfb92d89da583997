"""Tokenizer: encoding, decoding and chat templates must match transformers on the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from zerohop.engine.base.errors import InvalidRequestError, ModelLoadError
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.models.toy_tokenizer import save_tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces ",
    "Café naïve résumé jalapeño",
    "日本語のテキスト、中文文本",
    "Emoji 🙂🚀🎉 and a family 👩‍💻 ❤️",
    "special tokens inline: <|im_start|>user\nhi<|im_end|></s>",
    "def add(a, b):\n    return a + b\n\n\ttabs",
    "unseen words: xylophone quizzically zzz 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo 🙂, what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "日本語で?"},
]

# Llama-3 style: {% set %}, loop.first, raise_exception, tojson, bos_token.
LLAMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'Be helpful.' %}
{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools is not none %}{{ '\\nTools: ' + tools | tojson(indent=2) }}{% endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant') }}
    {%- endif %}
    {%- if loop.first %}{{ '<|im_start|>first\\n' }}{% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
    {%- if message.meta is defined %}{{ message.meta | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def ours(folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def reference(folder: Path):
    return AutoTokenizer.from_pretrained(folder)


def _with_template(tmp_path: Path, template: str, as_jinja_file: bool) -> Path:
    save_tokenizer(tmp_path)
    if as_jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    assert ours.encode(text) == reference(text)["input_ids"]
    plain = reference(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == plain


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = reference(text)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip
        )
    assert ours.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_special_tokens_and_sizes(ours: Tokenizer, reference) -> None:
    assert ours.bos_token_id == reference.bos_token_id == 0
    assert ours.eos_token_ids == {reference.eos_token_id}
    assert ours.vocab_size == len(reference)
    assert ours.id_to_token(3) == "<|im_end|>"
    assert ours.has_chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, reference, add_generation_prompt):
    expected = reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt) == expected
    assert expected.startswith("<s><|im_start|>system\n")
    ids = reference.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ours.encode_chat(CONVERSATION, add_generation_prompt) == ids


@pytest.mark.parametrize("as_jinja_file", [True, False])
def test_llama3_style_template(tmp_path: Path, as_jinja_file: bool) -> None:
    folder = _with_template(tmp_path, LLAMA3_TEMPLATE, as_jinja_file)
    ours, reference = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    tools = [{"name": "weather", "description": "Météo ☀️", "parameters": {"city": "string"}}]
    chats = [CONVERSATION, CONVERSATION[1:2], [{**CONVERSATION[1], "meta": {"k": "ü <tag>"}}]]
    for chat in chats:
        for extra in ({}, {"tools": tools}):
            expected = reference.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **extra
            )
            assert ours.apply_chat_template(chat, **extra) == expected
            ids = reference.apply_chat_template(chat, add_generation_prompt=True, **extra)
            assert ours.encode_chat(chat, **extra) == ids["input_ids"]
    assert '"ü <tag>"' in ours.apply_chat_template(chats[2])  # tojson: no ASCII/HTML escaping
    assert '\n    "name": "weather"' in ours.apply_chat_template(chats[1], tools=tools)


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    folder = _with_template(tmp_path, "FILE{{ messages[0]['content'] }}", as_jinja_file=True)
    messages = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_dir(folder).apply_chat_template(messages) == "FILEx"
    reference = AutoTokenizer.from_pretrained(folder)
    assert reference.apply_chat_template(messages, tokenize=False) == "FILEx"


def test_named_template_list_and_added_token_dicts(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ eos_token }}|{{ pad_token }}|{{ extra }}"},
    ]
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.apply_chat_template([], extra="e") == "<|im_end|>|</s>|e"
    assert tokenizer.eos_token_ids == {1, 3}


def test_eos_fallback_to_config_json(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {1, 3}


def test_raise_exception_becomes_invalid_request(tmp_path: Path) -> None:
    folder = _with_template(tmp_path, LLAMA3_TEMPLATE, as_jinja_file=False)
    tokenizer = Tokenizer.from_dir(folder)
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tokenizer.apply_chat_template(bad)
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        tokenizer.encode_chat(bad)


def test_no_chat_template(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert not tokenizer.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_broken_template_fails_at_load(tmp_path: Path) -> None:
    folder = _with_template(tmp_path, "{% for m in messages %}", as_jinja_file=True)
    with pytest.raises(ModelLoadError, match="chat template"):
        Tokenizer.from_dir(folder)


def test_template_sandbox(tmp_path: Path) -> None:
    folder = _with_template(tmp_path, "{{ messages.__class__.__mro__ }}", as_jinja_file=True)
    with pytest.raises(InvalidRequestError):
        Tokenizer.from_dir(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_add_bos_token_applies_without_post_processor(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_dir(tmp_path).encode("hi")[0] != 0
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.encode("hi") == [0, *tokenizer.encode("hi", add_special_tokens=False)]
