"""Incremental detokenizer: streamed text equals a full decode; stop strings cut it exactly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, trainers

from zerohop.engine.text.detokenizer import IncrementalDetokenizer
from zerohop.engine.text.tokenizer import Tokenizer
from zerohop.models.toy_tokenizer import corpus, save_tokenizer

MULTIBYTE = "Héllo 日本語 🙂🚀 👩‍💻 ❤️ привет, 中文。𝔘𝔫"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tok")
    save_tokenizer(folder)
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def sentencepiece_style(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A Llama-2/Mistral-style tokenizer: "▁" for spaces, byte fallback, a decoder that strips
    the leading space of the first token, so decoding depends on context."""
    backend = BackendTokenizer(models.BPE(byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=40,
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    data = json.loads(backend.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    folder = tmp_path_factory.mktemp("sp")
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_dir(folder)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    chunks = []
    for token_id in ids:
        text, stop = detok.push(token_id)
        chunks.append(text)
        if stop is not None:
            return chunks, stop
    chunks.append(detok.flush())
    return chunks, None


def byte_tokens(tokenizer: Tokenizer) -> list[int]:
    """Tokens that are pieces of multi-byte characters (they decode alone to U+FFFD)."""
    ids = range(tokenizer.vocab_size)
    return [i for i in ids if "\ufffd" in tokenizer.decode([i], skip_special_tokens=False)]


def test_split_multibyte_characters_are_held(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂🚀", add_special_tokens=False)
    assert len(ids) > 2  # the toy tokenizer splits each emoji into byte pieces
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [detok.push(i)[0] for i in ids]
    assert "".join(chunks) == "🙂🚀"
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert detok.flush() == ""
    assert detok.text == "🙂🚀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_match_full_decode(tokenizer: Tokenizer, skip_special_tokens: bool):
    rng = random.Random(7)
    pieces = byte_tokens(tokenizer)
    text_ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert pieces
    for _ in range(300):
        kind = rng.randrange(3)
        if kind == 0:  # anything from the vocabulary, special tokens included
            ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        elif kind == 1:  # mostly loose bytes of multi-byte characters
            ids = [rng.choice(pieces) for _ in range(rng.randrange(1, 20))]
        else:  # a slice of real multi-byte text, cut anywhere, with noise
            start = rng.randrange(len(text_ids))
            ids = text_ids[start : start + rng.randrange(1, 30)]
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([*pieces, 0, 3]))
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        chunks, stop = stream(detok, ids)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert stop is None
        assert "".join(chunks) == expected, ids
        assert detok.text == expected
        # Only the final flush may hold a replacement character the full decode has at its end.
        assert all(not c.endswith("\ufffd") for c in chunks[:-1] if c)


def test_context_dependent_decoder_matches_full_decode(sentencepiece_style: Tokenizer) -> None:
    tokenizer, rng = sentencepiece_style, random.Random(3)
    text = MULTIBYTE + " and more words"
    assert tokenizer.id_to_token(tokenizer.encode("日", add_special_tokens=False)[1]) == "<0xE6>"
    # In a full decode ByteFallback turns a whole run of byte tokens into U+FFFD when the run is
    # broken, complete characters included, while the stream has already sent those (as vLLM
    # does). So: whole characters only, and noise never splits a run of byte tokens.
    is_byte = [tokenizer.id_to_token(i).startswith("<0x") for i in range(tokenizer.vocab_size)]
    noise = [i for i, byte in enumerate(is_byte) if not byte]
    for _ in range(200):
        start = rng.randrange(len(text))
        ids = tokenizer.encode(text[start : start + rng.randrange(1, 25)], add_special_tokens=False)
        for _ in range(rng.randrange(3)):
            at = rng.randrange(len(ids) + 1)
            if at == 0 or not is_byte[ids[at - 1]]:
                ids.insert(at, rng.choice(noise))
        chunks, _ = stream(IncrementalDetokenizer(tokenizer), ids)
        assert "".join(chunks) == tokenizer.decode(ids), ids


def test_window_stays_short(tokenizer: Tokenizer) -> None:
    """Each step decodes a few recent tokens, not the whole output."""
    longest = 0

    class Recorder:  # the real backend, noting how many ids each decode gets
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return tokenizer.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapped:
        backend = Recorder()

    ids = tokens_of(tokenizer, MULTIBYTE * 20)
    chunks, _ = stream(IncrementalDetokenizer(Wrapped(), stop=["never"]), ids)  # type: ignore[arg-type]
    assert "".join(chunks) == MULTIBYTE * 20
    assert len(ids) > 300 and longest <= 8


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=True)
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)[0]) == "hi"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream(kept, ids)[0]) == "<s><|im_start|>hi<|im_end|>"


def tokens_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run(tokenizer: Tokenizer, text: str, stop: list[str]) -> tuple[str, str | None, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    chunks, matched = stream(detok, tokens_of(tokenizer, text))
    assert detok.text == "".join(chunks)
    assert detok.stop_reason == matched
    return "".join(chunks), matched, chunks


def test_stop_string_across_three_tokens(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokens_of(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    # A stop string that starts inside one token and ends inside the third after it.
    start = sum(len(p) for p in pieces[:3])
    stop = text[start - 1 : start + len(pieces[3]) + len(pieces[4]) + 1]
    assert not any(stop in p for p in pieces)
    out, matched, _ = run(tokenizer, text, [stop])
    assert matched == stop
    assert out == text[: text.index(stop)]


def test_stop_string_at_the_very_start(tokenizer: Tokenizer) -> None:
    out, matched, chunks = run(tokenizer, "Hello, world!", ["Hel"])
    assert (out, matched) == ("", "Hel")
    assert all(c == "" for c in chunks)


def test_overlapping_partial_match(tokenizer: Tokenizer) -> None:
    out, matched, _ = run(tokenizer, "abcabcabd and more", ["abcabd"])
    assert (out, matched) == ("abc", "abcabd")


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    # " over" is one token: every stop string below completes on the same push.
    assert " over" in [tokenizer.decode([i]) for i in tokens_of(tokenizer, "jumps over it")]
    out, matched, _ = run(tokenizer, "jumps over it", ["ver", "over", " ov"])
    assert (out, matched) == ("jumps", " ov")
    out, matched, _ = run(tokenizer, "jumps over it", ["over", "ove"])  # same start: first listed
    assert (out, matched) == ("jumps ", "over")


def test_first_completed_stop_string_ends_generation(tokenizer: Tokenizer) -> None:
    # "wo" completes two tokens before "two thr" could: generation stops there (as in vLLM).
    out, matched, _ = run(tokenizer, "one two three four", ["two thr", "wo"])
    assert (out, matched) == ("one t", "wo")


def test_possible_stop_prefix_is_held_then_released(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    emitted = []
    for token_id in tokens_of(tokenizer, "ok <EN"):
        text, stop = detok.push(token_id)
        emitted.append(text)
        assert stop is None
    assert "".join(emitted) == "ok "  # "<EN" could still become "<END>"
    assert detok.flush() == "<EN"
    assert detok.text == "ok <EN"


def test_no_output_after_stop(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=["fox"])
    _, matched = stream(detok, tokens_of(tokenizer, "the quick brown fox jumps"))
    assert matched == "fox"
    assert detok.push(tokens_of(tokenizer, "more")[0]) == ("", None)
    assert detok.flush() == ""
    assert detok.text == "the quick brown "


def test_stop_with_multibyte_text(tokenizer: Tokenizer) -> None:
    out, matched, chunks = run(tokenizer, MULTIBYTE, ["🚀"])
    assert (out, matched) == (MULTIBYTE[: MULTIBYTE.index("🚀")], "🚀")
    assert all("\ufffd" not in c for c in chunks)


def reference_stop(tokenizer: Tokenizer, ids: list[int], stops: list[str]):
    """Full decodes after each token: the first text holding a stop string, cut at the earliest."""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end])
        found = [(text.index(s), i) for i, s in enumerate(stops) if s in text]
        if found:
            index, which = min(found)
            return text[:index], stops[which]
    return tokenizer.decode(ids), None


def test_random_stop_strings_match_reference(tokenizer: Tokenizer) -> None:
    rng = random.Random(11)
    text = "abcabcabd " + MULTIBYTE + " The quick brown fox jumps over the lazy dog."
    ids = tokens_of(tokenizer, text)
    matches = 0
    for _ in range(200):
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 8)])
        if rng.random() < 0.3:
            stops = ["never matches", "zzz"] if rng.random() < 0.3 else [*stops, "never matches"]
        detok = IncrementalDetokenizer(tokenizer, stop=stops)
        chunks, matched = stream(detok, ids)
        expected = reference_stop(tokenizer, ids, stops)
        assert ("".join(chunks), matched) == expected, stops
        matches += matched is not None
    assert 100 < matches < 200
