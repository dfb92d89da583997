"""A `tokenizers` Tokenizer built from a GGUF file's `tokenizer.ggml.*` metadata.

Two vocabulary kinds, as llama.cpp names them:
- `gpt2`: byte-level BPE (tokens, merges), text split first by the regexes llama.cpp uses
  for the file's `tokenizer.ggml.pre`;
- `llama`: SentencePiece BPE (tokens, scores, byte-fallback tokens), merges from the file or
  recovered from the scores as transformers does.
Control tokens become special added tokens, user-defined ones plain added tokens.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from zerohop.engine.base.errors import ModelLoadError
from zerohop.engine.loading.gguf_file import GGUFFile
from zerohop.engine.text.byte_alphabet import byte_alphabet
from zerohop.engine.text.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (src/llama-vocab.cpp), written as
# the models' own tokenizer.json spell them. Several split in sequence.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT = r"\p{N}"
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(_LLAMA3_NAMES, (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), (_DIGIT, _GPT2)
    ),
}
# Vocabularies whose reference tokenizer.json matches whole words before merging.
_IGNORE_MERGES = set(_LLAMA3_NAMES)


def tokenizer_from_gguf(gguf: GGUFFile) -> Tokenizer:
    kind = gguf.require("tokenizer.ggml.model")
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    if kind == "gpt2":
        backend = _byte_level_bpe(gguf, tokens)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(gguf, tokens)
        add_bos_default = True  # llama.cpp and transformers add BOS unless the file says not
    else:
        raise ModelLoadError(
            f"{gguf.path}: field 'tokenizer.ggml.model' is {kind!r}; supported: gpt2, llama"
        )
    _add_special_tokens(backend, tokens, gguf.get("tokenizer.ggml.token_type") or [], kind)
    config = _tokenizer_config(gguf, tokens, add_bos_default)
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend, config, gguf.get("tokenizer.chat_template"), gguf.eos_token_ids(), bos
    )


def _tokenizer_config(gguf: GGUFFile, tokens: list[str], add_bos_default: bool) -> dict[str, Any]:
    """The tokenizer_config.json a Hugging Face folder would carry for this file."""
    config: dict[str, Any] = {
        "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos_default))
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    return config


def _byte_level_bpe(gguf: GGUFFile, tokens: list[str]) -> BackendTokenizer:
    pre = gguf.get("tokenizer.ggml.pre", "default")
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise ModelLoadError(
            f"{gguf.path}: field 'tokenizer.ggml.pre' is {pre!r}; supported:"
            f" {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    spelled = {_byte_spelling(token): i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    backend = BackendTokenizer(
        models.BPE(
            spelled, merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES, dropout=None
        )
    )
    if splits == (_GPT2,):
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(gguf: GGUFFile, tokens: list[str]) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = gguf.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        pairs = merges_from_scores(tokens, gguf.require("tokenizer.ggml.scores"))
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = BackendTokenizer(
        models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    prefix_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges implied by the vocabulary: every split of a token into two
    tokens, best-scored result first (the order transformers' `generate_merges` gives)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[Any, ...]] = []
    for token, score in zip(tokens, scores, strict=True):
        pieces = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        pieces.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates.extend((left, right, score) for left, right in pieces)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], types: list[int], kind: str
) -> None:
    # A byte-level control token spelled outside the byte alphabet is a converter mislabel;
    # adding it would grow the vocabulary past the model's (transformers skips them too).
    alphabet = _byte_characters() if kind == "gpt2" else None
    control, user = [], []
    for token, token_type in zip(tokens, types, strict=False):
        if token_type == CONTROL and (alphabet is None or set(token) <= alphabet):
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == USER_DEFINED and backend.token_to_id(token) is not None:
            user.append(AddedToken(token, special=False, normalized=False))
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


@cache
def _byte_characters() -> frozenset[str]:
    return frozenset(byte_alphabet().values())


def _byte_spelling(token: str) -> str:
    """A token as the byte-level vocabulary spells it (some files store added tokens raw)."""
    if set(token) <= _byte_characters():
        return token
    alphabet = byte_alphabet()
    return "".join(alphabet[b] for b in token.encode("utf-8"))
