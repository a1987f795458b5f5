"""A GGUF's tokenizer, built with `tokenizers` from the vocabulary in its metadata, and the tokenizer_config.json
(chat template, special tokens, BOS/EOS) that goes with it.

Two kinds of `tokenizer.ggml.model`, each as llama.cpp runs it:
- "gpt2": byte-level BPE with the file's merges, split first by the pre-tokenizer the file names
  (Llama 3, Qwen2/3, SmolLM);
- "llama": SentencePiece BPE (Gemma, Llama 2), built as Gemma's own tokenizer.json is: spaces as "▁", no
  pre-split, byte fallback, merges ranked by the merged piece's score (spm.py).
Any other kind, or pre-tokenizer, is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from grpo_fleet.models.gguf.metadata import GGUFError, Hyper, meta_bool, meta_int, meta_str
from grpo_fleet.models.gguf.spm import sentencepiece_tokenizer

TOKENIZER_KINDS = ("gpt2", "llama")
# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE (the regexes of each model's tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "gpt-2" is llama.cpp's name for GPT-2's own split (what export writes); "gpt2" and "default" are read as it too.
_SPLITS: dict[str, Optional[str]] = {"default": None, "gpt2": None, "gpt-2": None, "smollm": None, "qwen2": _QWEN2_SPLIT,
                                     "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
PRE_TOKENIZERS = tuple(_SPLITS)
# What a ggml token type means (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Control tokens that end a turn, by family: llama.cpp stops at these too (its end-of-generation set).
_TURN_ENDS = {"llama": ("<|eot_id|>", "<|eom_id|>"), "qwen3": ("<|im_end|>", "<|endoftext|>"), "gemma3": ("<end_of_turn>",)}
# Gemma's turn format, for a file that carries no template (Gemma 3's base models): a system message opens the
# first user turn, as in Google's template.
GEMMA_TEMPLATE = (
    r"{{ bos_token }}"
    r"{%- if messages and messages[0]['role'] == 'system' -%}"
    r"{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    r"{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    r"{%- for message in turns -%}"
    r"{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    r"{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}


@dataclass(frozen=True)
class Vocab:
    """The tokenizer metadata, checked: every list as long as the vocabulary, every id inside it."""

    kind: str
    tokens: list[str]
    types: list[int]
    scores: Optional[np.ndarray]
    merges: Optional[list[tuple[str, str]]]
    pre: str
    add_space_prefix: bool = False  # SentencePiece: a "▁" before the text (llama.cpp's default; Gemma 3 says no)
    unk: Optional[str] = None


def read_vocab(metadata: dict[str, Any], hyper: Hyper) -> Vocab:
    kind = meta_str(metadata, "tokenizer.ggml.model")
    allowed = hyper.family.tokenizers
    if kind not in TOKENIZER_KINDS or kind not in allowed:
        raise GGUFError(f"tokenizer model {kind!r} is not supported for {hyper.architecture} (supported: {', '.join(allowed)})")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise GGUFError("metadata 'tokenizer.ggml.tokens' is not a list of strings")
    if len(tokens) > hyper.vocab_size or len(set(tokens)) != len(tokens):
        raise GGUFError(f"metadata: {len(tokens)} tokens (some repeated, or more than the {hyper.vocab_size} embedding rows)")
    types = _numbers(metadata, "tokenizer.ggml.token_type", len(tokens), np.full(len(tokens), NORMAL))
    if types.size and (types.min() < 0 or types.max() > BYTE):
        raise GGUFError("metadata 'tokenizer.ggml.token_type' holds types llama.cpp does not define")
    pre = meta_str(metadata, "tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in _SPLITS:
        raise GGUFError(f"tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    scores = _numbers(metadata, "tokenizer.ggml.scores", len(tokens), None) if kind == "llama" else None
    if kind == "llama" and scores is None:
        raise GGUFError("a SentencePiece ('llama') tokenizer needs 'tokenizer.ggml.scores'")
    unk = meta_int(metadata, "tokenizer.ggml.unknown_token_id", 0, len(tokens) - 1, -1)
    return Vocab(kind, tokens, [int(t) for t in types], scores, _merges(metadata) if kind == "gpt2" else None, pre,
                 add_space_prefix=meta_bool(metadata, "tokenizer.ggml.add_space_prefix", kind == "llama"),
                 unk=tokens[unk] if unk >= 0 else None)


def _numbers(metadata: dict[str, Any], key: str, length: int, default: Optional[np.ndarray]) -> Any:
    value = metadata.get(key, default)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.shape != (length,) or not np.all(np.isfinite(value)):
        raise GGUFError(f"metadata {key!r} is not {length} finite numbers, one per token")
    return value


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise GGUFError("metadata 'tokenizer.ggml.merges' is not a list of 'left right' pairs")
    return [(left, right) for left, right in (m.split(" ") for m in merges)]


def build_tokenizer(vocab: Vocab) -> Any:
    """A `tokenizers.Tokenizer` for the vocabulary, its control tokens special, its user-defined ones whole."""
    from tokenizers import AddedToken

    if vocab.kind == "gpt2":
        tokenizer = _byte_level(vocab)
    else:
        tokenizer = sentencepiece_tokenizer(vocab.tokens, vocab.types, np.asarray(vocab.scores),
                                            add_space_prefix=vocab.add_space_prefix, unk=vocab.unk)
    tokenizer.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(vocab.types) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                          for i, t in enumerate(vocab.types) if t == USER_DEFINED])
    return tokenizer


def _byte_level(vocab: Vocab) -> Any:
    from tokenizers import Tokenizer, decoders, models, processors

    bpe = models.BPE(vocab={token: index for index, token in enumerate(vocab.tokens)}, merges=vocab.merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(vocab.pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def byte_level_pre_tokenizer(pre: str) -> Any:
    """How the model named by `tokenizer.ggml.pre` splits text before BPE, as its own tokenizer.json does."""
    from tokenizers import Regex, pre_tokenizers

    split = _SPLITS[pre]
    if pre == "smollm":  # SmolLM's tokenizer.json: every digit alone, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@dataclass(frozen=True)
class Specials:
    """The special token ids the metadata names, each checked to be inside the vocabulary."""

    bos: Optional[int]
    eos: list[int]  # the file's EOS first, then the family's end-of-turn tokens
    unk: Optional[int]
    pad: Optional[int]
    add_bos: bool


def read_specials(metadata: dict[str, Any], vocab: Vocab, hyper: Hyper) -> Specials:
    count = len(vocab.tokens)

    def token_id(key: str, required: bool = False) -> Optional[int]:
        name = f"tokenizer.ggml.{key}"
        if name not in metadata and not required:
            return None
        return meta_int(metadata, name, 0, count - 1)

    eos = [token_id("eos_token_id", required=True)]
    eos += [i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
    eos += [vocab.tokens.index(t) for t in _TURN_ENDS.get(hyper.architecture, ()) if t in vocab.tokens
            and vocab.types[vocab.tokens.index(t)] == CONTROL]
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise, not to a byte-level one.
    add_bos = meta_bool(metadata, "tokenizer.ggml.add_bos_token", vocab.kind == "llama")
    return Specials(bos=token_id("bos_token_id"), eos=list(dict.fromkeys(e for e in eos if e is not None)),
                    unk=token_id("unknown_token_id"), pad=token_id("padding_token_id"), add_bos=add_bos)


def tokenizer_config(metadata: dict[str, Any], vocab: Vocab, specials: Specials, hyper: Hyper) -> dict[str, Any]:
    """tokenizer_config.json: the chat template (the file's, else the family's), the special tokens, BOS/EOS handling."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": hyper.context_length,
        "add_bos_token": specials.add_bos,
        "add_eos_token": meta_bool(metadata, "tokenizer.ggml.add_eos_token", False),
        "clean_up_tokenization_spaces": False,
        "bos_token": _text(vocab, specials.bos),
        "eos_token": _text(vocab, specials.eos[0]),
        "unk_token": _text(vocab, specials.unk),
        "pad_token": _text(vocab, specials.pad),
    }
    template = meta_str(metadata, "tokenizer.chat_template", _DEFAULT_TEMPLATES.get(hyper.architecture, ""))
    if template:
        config["chat_template"] = template
    return config


def _text(vocab: Vocab, index: Optional[int]) -> Optional[str]:
    return None if index is None else vocab.tokens[index]


def with_bos(tokenizer: Any, vocab: Vocab, specials: Specials) -> Any:
    """Prepend BOS in the tokenizer itself when llama.cpp would (fast tokenizers ignore add_bos_token)."""
    from tokenizers import processors

    if specials.bos is None or not specials.add_bos:
        return tokenizer
    bos = vocab.tokens[specials.bos]
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials.bos)])
    steps = [processors.ByteLevel(trim_offsets=False), template] if vocab.kind == "gpt2" else [template]
    tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer
