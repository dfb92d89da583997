"""A Hugging Face tokenizer folder: tokenizer.json, special tokens and the chat template.

Encoding, decoding and chat-template rendering match `transformers.AutoTokenizer` on the
same folder, without importing transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from zerohop.engine.base.errors import InvalidRequestError, ModelLoadError

# The named special tokens transformers passes to chat templates, in its order.
# One chat message as the template reads it: role, content and whatever else a template may
# use (tool_calls, thinking, ...), JSON-shaped, so its values are Any.
ChatMessage = dict[str, Any]
SPECIAL_TOKEN_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """Encodes text to token ids and back, and renders chat messages to a prompt."""

    def __init__(
        self,
        backend: BackendTokenizer,
        config: dict[str, Any],
        chat_template: str | None,
        extra_eos_ids: list[int],
        fallback_bos_id: int | None,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.special_tokens = _named_special_tokens(config)
        _add_missing_special_tokens(backend, config, self.special_tokens.values())
        # tokenizer.json's post-processor adds bos, as in transformers; `add_bos_token` only
        # counts when it has none (transformers 4's Llama tokenizers honoured it there).
        self._add_bos = backend.post_processor is None and bool(config.get("add_bos_token"))
        self._chat_template = chat_template
        self._compiled = _compile_template(chat_template) if chat_template else None
        eos_ids = set(extra_eos_ids)
        if (eos_id := self._token_id("eos_token")) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        bos_id = self._token_id("bos_token")
        self.bos_token_id: int | None = bos_id if bos_id is not None else fallback_bos_id

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: tokenizer.json not found")
        try:
            backend = BackendTokenizer.from_file(str(file))
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot load tokenizer: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")
        eos = generation.get("eos_token_id", model_config.get("eos_token_id"))
        bos = generation.get("bos_token_id", model_config.get("bos_token_id"))
        template = _read_chat_template(folder, config)
        try:
            return cls(backend, config, template, _as_id_list(eos), bos)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"{folder}: chat template does not parse: {exc}") from exc

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._compiled is not None

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if self._compiled is None:
            raise InvalidRequestError(
                "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); send a plain prompt instead"
            )
        variables = {**self.special_tokens, "tools": None, "documents": None, **extra}
        variables["messages"] = _normalize_messages(messages)
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled.render(**variables)
        except Exception as exc:  # the template is a program; any failure is this request's
            raise InvalidRequestError(f"chat template error: {exc}") from exc

    def encode_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return value


def _read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():  # transformers saves it here, and it wins over the config entry
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template if isinstance(template, str) else None


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(f"{name}_token"))
        if content is not None:
            tokens[f"{name}_token"] = content
    return tokens


def _add_missing_special_tokens(
    backend: BackendTokenizer, config: dict[str, Any], named: Any
) -> None:
    """Register special tokens the config names but tokenizer.json lacks, as transformers does."""
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    wanted = [*named, *(t for t in map(_token_content, extra) if t is not None)]
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(t, special=True, normalized=False) for t in wanted if t not in present]
    if missing:
        backend.add_special_tokens(missing)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _normalize_messages(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Drop None values and alias reasoning fields, as transformers does before rendering."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequestError(f"chat messages must be objects, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, **options: Any) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (indent etc. allowed).
    return json.dumps(x, ensure_ascii=ensure_ascii, **options)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body as is (some templates use it)."""

    tags = {"generation"}  # noqa: RUF012 - the Extension API reads a class attribute

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
