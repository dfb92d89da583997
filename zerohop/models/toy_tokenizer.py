"""A small byte-level BPE tokenizer trained locally, for the built-in `tiny` model and tests.

Nothing can be downloaded here, so tiny models get a real `tokenizers` tokenizer trained
on a built-in corpus that includes multi-byte UTF-8 text (accents, CJK, emoji).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<s>"
EOS = "</s>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A request crosses a load balancer, an ingress and a gateway before the model.",
    "zerohop serves tokens the moment they are decoded, over HTTP and gRPC.",
    "Paged attention keeps the key and value cache in fixed-size blocks.",
    "Continuous batching admits new sequences while others are still decoding.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026 3.14159",
    "Café, naïve, résumé, über, señor, façade, jalapeño.",
    "日本語のテキストも正しく扱います。東京は大きな都市です。",
    "中文文本也要正确处理。你好，世界！",
    "Emoji survive streaming: 🙂 🚀 🎉 👩‍💻 ❤️",
    "Ελληνικά και русский текст: привет, мир!",
    "def add(a, b):\n    return a + b\n",
    '{"key": "value", "list": [1, 2, 3]}',
]


def corpus(repeats: int = 40) -> list[str]:
    """A deterministic training corpus."""
    lines = []
    for i in range(repeats):
        for j, sentence in enumerate(_SENTENCES):
            lines.append(sentence if (i + j) % 3 else sentence.lower())
    return lines


def train_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def save_tokenizer(folder: Path, vocab_size: int = 512) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": EOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer
