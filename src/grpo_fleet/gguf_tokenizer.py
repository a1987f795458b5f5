"""A GGUF's byte-level BPE tokenizer, built with `tokenizers` from the vocabulary, merges and token types in its
metadata, and the tokenizer_config.json (chat template, special tokens, BOS/EOS) that goes with it."""

from __future__ import annotations

from typing import Any, Optional, cast

import mlx.core as mx

from grpo_fleet.gguf_metadata import GGUFError, Hyper, meta, scalar

# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE (the regexes of each model's tokenizer.json).
_GPT2_SPLIT = None  # ByteLevel's own GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "qwen2", "llama-bpe", "llama3")
# What a ggml token type means (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}.get(pre, _GPT2_SPLIT)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` for the byte-level BPE vocabulary the metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = str(meta(metadata, "tokenizer.ggml.model"))
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(pair.split(" ", 1)) for pair in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(str(meta(metadata, "tokenizer.ggml.pre", "default")))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _int_list(metadata.get("tokenizer.ggml.token_type"))
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == _USER_DEFINED])
    return tokenizer


def _int_list(value: Any) -> list[int]:
    """An int array from the metadata (absent: empty)."""
    values = [] if value is None else mx.array(value).reshape(-1).tolist()
    return [int(x) for x in cast(list[int], values)]


def _token(metadata: dict[str, Any], key: str) -> Optional[str]:
    index = metadata.get(f"tokenizer.ggml.{key}")
    return None if index is None else str(metadata["tokenizer.ggml.tokens"][int(scalar(index))])


def tokenizer_config(metadata: dict[str, Any], hyper: Hyper) -> dict[str, Any]:
    """tokenizer_config.json: the chat template, the special tokens and BOS/EOS handling."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": hyper.context_length,
        "add_bos_token": bool(scalar(metadata.get("tokenizer.ggml.add_bos_token", False))),
        "add_eos_token": bool(scalar(metadata.get("tokenizer.ggml.add_eos_token", False))),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        config[name] = _token(metadata, key)
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    return config


def with_bos(tokenizer: Any, metadata: dict[str, Any]) -> Any:
    """Prepend BOS in the tokenizer itself when the file says llama.cpp adds one (fast tokenizers ignore add_bos_token)."""
    from tokenizers import processors

    bos = _token(metadata, "bos_token_id")
    if bos is None or not bool(scalar(metadata.get("tokenizer.ggml.add_bos_token", False))):
        return tokenizer
    bos_id = int(scalar(metadata["tokenizer.ggml.bos_token_id"]))
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]),
    ])
    return tokenizer
