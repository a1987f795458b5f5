"""A Qwen2-style byte-level BPE tokenizer that covers a whole vocabulary, built without a hub.

Real-shape models need a tokenizer whose every id (all 151,936 of Qwen2.5's) is a
token, so any id a random policy samples decodes, with Qwen's special tokens at
Qwen's ids and its chat template, so the chat path works as with the real model.
The regular tokens are the 256 byte tokens and deterministic merges of them, in
the `tokenizers` library's own format, loaded by transformers like Qwen's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Qwen2's special tokens at Qwen2's ids (151643..151664).
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]
FIRST_SPECIAL_ID = 151643
# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, spaces.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5-Instruct's template without the tool branches: same text for plain chats.
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in its id order (what Qwen's first 256 ids are)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(rest)}
    return [chars[b] for b in printable + rest]


def _merge_order(alphabet: list[str]) -> list[str]:
    """Bytes ordered so that merges of space, letters and digits come first (text uses them most)."""
    space = chr(256 + 32)  # 'Ġ', the byte-level space
    common = [space, *"etaoinshrdlucmfwypvbgkjqxz", *"ETAOINSHRDLUCMFWYPVBGKJQXZ", *"0123456789", *".,:;!?'\"-()"]
    return common + [ch for ch in alphabet if ch not in common]


def _synthetic_merges(alphabet: list[str], count: int) -> list[tuple[str, str]]:
    """`count` BPE merges: every byte pair, then pair + byte, in a fixed order (deterministic)."""
    order = _merge_order(alphabet)
    merges = [(a, b) for a in order for b in order][:count]
    pairs = [a + b for a, b in merges]
    for prefix in pairs:
        if len(merges) >= count:
            break
        merges.extend((prefix, c) for c in order[: count - len(merges)])
    return merges


def build_tokenizer(vocab_size: int) -> Any:
    """A Qwen2-style byte-level BPE tokenizer whose ids are exactly 0..vocab_size-1, every one a token.

    Regular tokens fill every id but Qwen's special ids (151643..151664), so the
    special tokens keep Qwen's numbers and nothing in the embedding is unreachable.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    merges = _synthetic_merges(alphabet, vocab_size - len(QWEN_SPECIALS) - len(alphabet))
    regular = alphabet + [a + b for a, b in merges]
    special_ids = range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(QWEN_SPECIALS))
    free_ids = [i for i in range(vocab_size) if i not in special_ids]
    vocab = dict(zip(regular, free_ids)) | dict(zip(QWEN_SPECIALS, special_ids))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    # The specials are already in the vocabulary, so adding them keeps their ids.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    return tokenizer


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json the way Qwen2.5-Instruct has them."""
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": QWEN_CHAT_TEMPLATE,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
