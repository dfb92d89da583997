"""GGUF files: weights, tokenizer and chat template must match transformers on the same file.

The files are written by `tests/fixtures/tiny_gguf.py` from the tiny random models, as llama.cpp's
converter would write them, in every weight type zerohop reads. transformers (which dequantizes
with the same `gguf` package) loads each file too and is the reference: greedy ids, token ids and
rendered chat templates must be identical. Broken or unsupported files must raise ModelLoadError
naming the file and what is wrong with it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, pre_tokenizers

from tests.fixtures.tiny_gguf import (
    K_QUANT_OVERRIDES,
    K_QUANTS,
    GgufContents,
    bpe_vocab,
    gguf_contents,
    hf_gguf_greedy,
    load_hf_gguf,
    load_hf_gguf_tokenizer,
    quantize,
    spm_vocab,
    write_contents,
    write_gguf,
)
from tests.fixtures.tiny_models import (
    BOS_ID,
    LINEAR_ROPE,
    LLAMA3_ROPE,
    build_tiny_model,
    hf_greedy,
    load_hf_model,
)
from zerohop import LLM, SamplingParams
from zerohop.engine.base.errors import ModelLoadError
from zerohop.models.toy_tokenizer import corpus

QT = gguf.GGMLQuantizationType
MAX_NEW = 8
ARCHS = ["llama", "qwen2", "qwen3"]
BLOCK_32_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]

# transformers reads no `qwen3.attention.key_length` and takes Qwen3Config's default head_dim
# (128), so a qwen3 file it can load must have head_dim 128. The key_length test below uses 32.
_BASE_OVERRIDES = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 128}}

TEXTS = [
    "Hello, world!",
    "",
    " leading and trailing spaces ",
    "Café naïve résumé jalapeño Ünïcödé",
    "日本語のテキスト、中文文本。東京は大きな都市です",
    "Ελληνικά και русский текст: привет, мир!",
    "Emoji 🙂🚀🎉 and a family 👩‍💻 ❤️",
    "digits 0 12 345 6789 3.14159 2026-01-01",
    "line one\nline two\n\n\ttabbed  double  spaced\r\n",
    "special tokens inline: <|im_start|>user\nhi<|im_end|></s> <s>",
    "unseen words: xylophone quizzically zzz 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo 🙂, what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "日本語で? по-русски?"},
]

Factory = Callable[..., Path]


# ------------------------------------------------------------------------------------------
# Fixtures: tiny models, their GGUF files, and zerohop on them (each built once per session)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Factory:
    """`hf_folder("qwen2", kquant=True)` -> tiny HF model folder (K-quant-sized if asked)."""
    root = tmp_path_factory.mktemp("gguf_hf")
    built: dict[tuple, Path] = {}

    def get(arch: str, kquant: bool = False, **extra) -> Path:
        overrides = {**(K_QUANT_OVERRIDES[arch] if kquant else _BASE_OVERRIDES[arch]), **extra}
        key = (arch, repr(sorted(overrides.items())))
        if key not in built:
            parts = (re.sub(r"[^\w.]", "", f"{k}{v}") for k, v in sorted(overrides.items()))
            name = "-".join([arch, *parts])
            built[key] = build_tiny_model(root / name, arch, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A folder of its own: transformers would read a tokenizer_config.json lying beside a file.
    return tmp_path_factory.mktemp("gguf_files")


@pytest.fixture(scope="session")
def gguf_file(hf_folder: Factory, gguf_dir: Path) -> Factory:
    """`gguf_file("llama", "Q4_K")` -> that tiny model as a GGUF file of that type."""
    written: dict[tuple[str, str], Path] = {}

    def get(arch: str, qtype: str) -> Path:
        if (arch, qtype) not in written:
            folder = hf_folder(arch, kquant=QT[qtype] in K_QUANTS)
            path = gguf_dir / f"tiny-{arch}-{qtype}.gguf"
            written[arch, qtype] = write_gguf(folder, path, qtype)
        return written[arch, qtype]

    return get


_LLMS: dict[Path, LLM] = {}


def zerohop(path: Path) -> LLM:
    """zerohop's LLM on the GGUF file at `path`, loaded once per file, dequantized to float32
    as transformers does (the quantized kernels are tested in test_quant.py)."""
    if path not in _LLMS:
        _LLMS[path] = LLM(
            str(path), num_kv_blocks=64, max_num_batched_tokens=256, quantization="none"
        )
    return _LLMS[path]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(4, vocab_size) for _ in range(n)] for n in (5, 23)]


def assert_greedy_matches(path: Path, vocab_size: int, seed: int = 0) -> None:
    prompts = random_prompts(vocab_size, seed)
    outs = zerohop(path).generate(prompts, greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_NEW, out
        want = hf_gguf_greedy(path, prompt, MAX_NEW)
        assert out.token_ids == want, f"{path.name}: prompt of {len(prompt)} diverges"


# ------------------------------------------------------------------------------------------
# The fixture itself, against transformers alone (no zerohop)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quantizers_round_trip(qtype: str) -> None:
    """Our K-quant blocks decode (with gguf's own dequantizer) to within half a step."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32) * 0.3
    x[1, :256] = 0.0  # an all-zero block
    x[2] = np.abs(x[2]) + 0.5  # all positive, away from zero
    x[3] = -np.abs(x[3])  # all negative
    x[4, 7] = 40.0  # one outlier
    packed = quantize(x, QT[qtype])
    assert packed.dtype == np.uint8
    assert packed.shape == (8, 2 * gguf.GGML_QUANT_SIZES[QT[qtype]][1])
    y = gguf.quants.dequantize(packed, QT[qtype])
    assert y.shape == x.shape and np.all(y[1, :256] == 0.0)
    # Per sub-block of 32 values (16 for Q6_K), the error is at most half a step: the sub-block's
    # range over the levels, plus up to two units of the block's 6-bit (8-bit) sub-scale grid.
    sub = 16 if qtype == "Q6_K" else 32
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 62}[qtype]
    xs = x.reshape(8, 2, 256 // sub, sub)
    err = np.abs(y - x).reshape(xs.shape).max(-1)
    if qtype == "Q6_K":
        span = 2 * np.abs(xs).max(-1)
    else:
        span = np.maximum(xs.max(-1), 0) - np.minimum(xs.min(-1), 0)
    grid = span.max(-1, keepdims=True) / levels / (127 if qtype == "Q6_K" else 63)
    bound = 0.5 * (span / levels + 2 * grid) + 1e-6
    assert np.all(err <= bound), (err / bound).max()
    assert err.max() > 0  # it did quantize


@pytest.mark.parametrize(
    ("arch", "extra"),
    [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True})],
)
def test_f32_file_loads_in_transformers_as_the_folder(
    hf_folder: Factory, gguf_dir: Path, arch: str, extra: dict
) -> None:
    """transformers on our F32 file computes the original folder's logits exactly: the tensor
    names, the metadata and llama's q/k permutation are as llama.cpp writes them."""
    folder = hf_folder(arch, **extra)
    path = write_gguf(folder, gguf_dir / f"reference-{folder.name}.gguf", "F32")
    ids = torch.tensor([random_prompts(512, 1)[1]])
    with torch.inference_mode():
        got = load_hf_gguf(path)(ids).logits
        want = load_hf_model(folder)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) != bool(extra.get("tie_word_embeddings"))
    stored = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data
    original = load_hf_model(folder).model.layers[0].self_attn.q_proj.weight.detach().numpy()
    # llama's rows are permuted for ggml's interleaved RoPE; qwen's (NeoX RoPE) are not.
    assert np.array_equal(stored, original) == (arch != "llama")


def test_transformers_reads_our_vocabularies(hf_folder: Factory, gguf_dir: Path) -> None:
    """The gpt2 vocabulary with the split the toy tokenizer was trained with ("gpt-2")
    tokenizes exactly as the folder's tokenizer.json."""
    from transformers import AutoTokenizer

    folder = hf_folder("llama")
    path = write_gguf(folder, gguf_dir / "vocab-gpt-2.gguf", "F32", pre="gpt-2")
    ours, reference = load_hf_gguf_tokenizer(path), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
    assert ours.chat_template == reference.chat_template


# ------------------------------------------------------------------------------------------
# zerohop on GGUF files: greedy ids identical to transformers on the same file
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK_32_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(gguf_file: Factory, arch: str, qtype: str) -> None:
    assert_greedy_matches(gguf_file(arch, qtype), 512)


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_k_quants(gguf_file: Factory, arch: str, qtype: str) -> None:
    path = gguf_file(arch, qtype)
    assert gguf.GGUFReader(path).tensors[0].tensor_type == QT[qtype]  # token_embd
    assert_greedy_matches(path, 512, seed=1)


def test_mixed_types_like_q4_k_m(hf_folder: Factory, gguf_dir: Path) -> None:
    """Per-tensor types as llama.cpp's Q4_K_M mixes them, plus F16 and Q8_0."""
    types = {r"^output\.": "Q6_K", r"ffn_down": "Q6_K", r"attn_v": "Q8_0", r"blk\.1\.attn_q": "F16"}
    path = write_gguf(hf_folder("llama", kquant=True), gguf_dir / "mixed.gguf", "Q4_K", types=types)
    found = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert found["output.weight"] == QT.Q6_K and found["blk.0.attn_v.weight"] == QT.Q8_0
    assert found["blk.1.attn_q.weight"] == QT.F16 and found["blk.0.attn_k.weight"] == QT.Q4_K
    assert found["blk.0.attn_norm.weight"] == QT.F32
    assert_greedy_matches(path, 512, seed=2)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("qwen2", {}),
        # head_dim 32 != 64 / 4 heads: only `attention.key_length` says so.
        ("qwen3", {"head_dim": 32}),
        ("llama", {"tie_word_embeddings": True}),
        # Scaled RoPE: `rope.scaling.*` keys, and Llama 3's `rope_freqs` tensor of divisors.
        ("llama", {"rope_parameters": LINEAR_ROPE}),
        ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ],
    ids=["llama", "qwen2", "qwen3-head32", "llama-tied", "llama-linear-rope", "llama3-rope"],
)
def test_f32_file_matches_the_original_folder(
    hf_folder: Factory, gguf_dir: Path, arch: str, extra: dict
) -> None:
    """An F32 file is the folder's model: zerohop on it equals transformers on the folder."""
    folder = hf_folder(arch, **extra)
    path = write_gguf(folder, gguf_dir / f"same-{folder.name}.gguf", "F32")
    prompts = random_prompts(512, 3)
    for prompt, out in zip(prompts, zerohop(path).generate(prompts, greedy()), strict=True):
        assert out.token_ids == hf_greedy(folder, prompt, MAX_NEW), f"{path.name}"


# ------------------------------------------------------------------------------------------
# Tokenizer and chat template from the file's metadata
# ------------------------------------------------------------------------------------------

VOCABS = ["bpe-gpt-2", "bpe-llama-bpe", "bpe-qwen2", "spm", "spm-merges"]


@pytest.fixture(scope="session")
def vocab_file(hf_folder: Factory, gguf_dir: Path) -> Factory:
    """`vocab_file("spm")` -> a Q8_0 tiny llama whose metadata holds that vocabulary."""
    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in written:
            if kind.startswith("bpe-"):
                folder = hf_folder("llama")
                vocab = bpe_vocab(folder, pre=kind.removeprefix("bpe-"))
            else:
                vocab = spm_vocab(with_merges=kind == "spm-merges")
                folder = hf_folder("llama", vocab_size=len(vocab))
            path = gguf_dir / f"vocab-{kind}.gguf"
            written[kind] = write_gguf(folder, path, "Q8_0", vocab=vocab)
        return written[kind]

    return get


_HF_TOKENIZERS: dict[Path, object] = {}


def reference_tokenizer(path: Path):
    if path not in _HF_TOKENIZERS:
        _HF_TOKENIZERS[path] = load_hf_gguf_tokenizer(path)
    return _HF_TOKENIZERS[path]


@pytest.mark.parametrize("kind", VOCABS)
def test_encode_decode_match_transformers(vocab_file: Factory, kind: str) -> None:
    path = vocab_file(kind)
    ours, reference = zerohop(path).tokenizer, reference_tokenizer(path)
    for text in TEXTS:
        want = reference(text)["input_ids"]
        assert ours.encode(text) == want, f"{kind}: {text!r}"
        plain = reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == plain, f"{kind}: {text!r}"
        for skip in (True, False):
            expected = reference.decode(want, skip_special_tokens=skip)
            assert ours.decode(want, skip_special_tokens=skip) == expected, f"{kind}: {text!r}"
        # Nothing is lost (byte fallback / byte-level spell every character), but for the
        # SentencePiece prefix space: " a" and "a" both encode as "▁a", which decodes as "a".
        lost = kind.startswith("spm") and text.startswith(" ")
        round_trip = text[1:] if lost else text
        assert ours.decode(plain, skip_special_tokens=False) == round_trip, f"{kind}: {text!r}"
    assert ours.encode("x")[0] == reference.bos_token_id == ours.bos_token_id  # add_bos_token


def test_smollm_pre_tokenizer_splits_digits_as_smollm2s_tokenizer_json(
    hf_folder: Factory, gguf_dir: Path
) -> None:
    """transformers ignores `tokenizer.ggml.pre = "smollm"` (the default model's), so the
    reference is the pipeline SmolLM2's own tokenizer.json declares: digits one by one, then
    GPT-2's byte-level split."""
    folder = hf_folder("llama")
    path = write_gguf(
        folder, gguf_dir / "vocab-smollm.gguf", "Q8_0", vocab=bpe_vocab(folder, "smollm")
    )
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    ours = zerohop(path).tokenizer
    for text in TEXTS:
        want = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == want, text
    digits = ours.encode("2026", add_special_tokens=False)
    assert [ours.decode([i]) for i in digits] == ["2", "0", "2", "6"]


@pytest.mark.parametrize("kind", ["bpe-gpt-2", "spm"])
def test_vocabularies_are_what_the_file_says(vocab_file: Factory, kind: str) -> None:
    path = vocab_file(kind)
    ours, reference = zerohop(path).tokenizer, reference_tokenizer(path)
    # Not len(reference): for a gpt2 vocabulary with no unknown token transformers adds
    # GPT2Tokenizer's default "<|endoftext|>" as a 513th token, which the file does not have.
    assert ours.vocab_size == len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    assert ours.vocab_size == reference.vocab_size
    assert ours.eos_token_ids == {reference.eos_token_id}
    assert ours.id_to_token(reference.eos_token_id) == "<|im_end|>"
    # Specials and the chat markers stay whole; text around them is ordinary text.
    ids = ours.encode("<|im_start|>user\n<s>", add_special_tokens=False)
    assert ids[0] == reference.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == reference.bos_token_id
    if kind == "spm":
        # A character the training corpus never had is spelled in byte-fallback tokens.
        absent = "𝔘"
        assert absent not in "".join(corpus())
        ids = ours.encode(absent, add_special_tokens=False)
        byte_tokens = [f"<0x{b:02X}>" for b in absent.encode()]
        assert [ours.id_to_token(i) for i in ids[-len(byte_tokens) :]] == byte_tokens


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("kind", ["bpe-gpt-2", "spm"])
def test_chat_template_from_the_file(vocab_file: Factory, kind: str, add_generation_prompt: bool):
    path = vocab_file(kind)
    ours, reference = zerohop(path).tokenizer, reference_tokenizer(path)
    expected = reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert expected.startswith("<s><|im_start|>system\n")
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt) == expected
    ids = reference.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert ours.encode_chat(CONVERSATION, add_generation_prompt) == ids


@pytest.mark.parametrize("kind", ["bpe-qwen2", "spm"])
def test_text_prompt_generates_as_transformers(vocab_file: Factory, kind: str) -> None:
    path = vocab_file(kind)
    text = "Café 日本語 привет 🙂 42\nThe quick brown fox"
    (out,) = zerohop(path).generate([text], greedy())
    assert out.prompt_token_ids == reference_tokenizer(path)(text)["input_ids"]
    assert out.token_ids == hf_gguf_greedy(path, out.prompt_token_ids, MAX_NEW)


# ------------------------------------------------------------------------------------------
# Files zerohop cannot load: ModelLoadError naming the file and what is wrong
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def base_contents(hf_folder: Factory) -> Callable[..., GgufContents]:
    """Fresh contents of a valid file to break (a new object each call)."""

    def get(kquant: bool = False) -> GgufContents:
        return gguf_contents(hf_folder("llama", kquant=kquant), "Q8_0" if not kquant else "Q4_K")

    return get


def assert_load_error(path: Path, *needles: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=256)
    message = str(info.value)
    assert path.name in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(base_contents, gguf_dir: Path, arch: str) -> None:
    contents = base_contents()
    contents.rename_arch(arch)
    path = write_contents(contents, gguf_dir / f"bad-arch-{arch}.gguf")
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == arch
    assert_load_error(path, arch)


@pytest.mark.parametrize(("qtype", "kquant"), [("IQ4_NL", False), ("Q2_K", True), ("TQ2_0", True)])
def test_unsupported_tensor_type(base_contents, gguf_dir: Path, qtype: str, kquant: bool) -> None:
    contents = base_contents(kquant)
    name = "blk.1.ffn_down.weight"
    data, _ = contents.tensors[name]
    rows, row_len = data.shape[0], contents.kv["llama.feed_forward_length"][0]
    block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = np.random.default_rng(0).integers(0, 256, (rows, row_len // block * size), np.uint8)
    contents.tensors[name] = (raw, QT[qtype])
    path = write_contents(contents, gguf_dir / f"bad-type-{qtype}.gguf")
    found = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert found[name] == QT[qtype]
    assert_load_error(path, name, qtype)


@pytest.mark.parametrize(
    "key", ["llama.attention.head_count", "llama.block_count", "tokenizer.ggml.tokens"]
)
def test_missing_metadata(base_contents, gguf_dir: Path, key: str) -> None:
    contents = base_contents()
    del contents.kv[key]
    path = write_contents(contents, gguf_dir / f"missing-{key}.gguf")
    assert key not in gguf.GGUFReader(path).fields
    assert_load_error(path, key)


def test_missing_tensor(base_contents, gguf_dir: Path) -> None:
    contents = base_contents()
    del contents.tensors["blk.1.ffn_up.weight"]
    path = write_contents(contents, gguf_dir / "missing-tensor.gguf")
    assert_load_error(path, "blk.1.ffn_up.weight")


def test_truncated_and_garbage_files(gguf_file: Factory, gguf_dir: Path) -> None:
    whole = gguf_file("llama", "F16").read_bytes()
    truncated = gguf_dir / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    assert_load_error(truncated)
    header_only = gguf_dir / "header-only.gguf"
    header_only.write_bytes(whole[:24])
    assert_load_error(header_only)
    garbage = gguf_dir / "not-a-gguf.gguf"
    garbage.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    assert_load_error(garbage)
