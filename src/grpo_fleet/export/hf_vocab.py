"""The tokenizer of an mlx-lm (Hugging Face) directory as GGUF metadata, as llama.cpp's convert_hf_to_gguf.py writes
it for the families export writes:

- byte-level BPE (Llama 3, SmolLM, Qwen2/3): `tokenizer.ggml.model` "gpt2", the vocabulary in id order, the merges,
  and the name of the pre-tokenizer llama.cpp must split text with. The converter recognises that by hashing a
  tokenization; here each name import-gguf knows is tried on probe texts, and the one whose split equals the
  directory's own pre-tokenizer's is written;
- SentencePiece-style BPE with byte fallback (Gemma, Llama 2): "llama", with scores. llama.cpp joins the adjacent
  pair whose joined piece scores best; the directory's BPE joins the pair whose merge comes first, so each piece
  scores minus the rank of the first merge that makes it.

Token types are convert_hf_to_gguf's: an added token is CONTROL when the tokenizer calls it special, USER_DEFINED
when not; <0xNN> pieces of a byte-fallback BPE are BYTE; ids the tokenizer lacks up to the embedding's rows are
"[PADn]", UNUSED. The special ids, the merges and the chat template are the `gguf` package's SpecialVocab's reading of
the same files. Any other tokenizer is refused in one line that says what llama.cpp would lack.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gguf import GGUFWriter, SpecialVocab, TokenType

from grpo_fleet.export.source import ExportError
from grpo_fleet.models.gguf.spm import SPACE
from grpo_fleet.models.gguf.tokenizer import byte_level_pre_tokenizer

# llama.cpp's names for the splits import-gguf also reads, the most specific first (SmolLM's splits digits, Qwen2's
# keeps each digit alone, Llama 3's groups three, GPT-2's keeps a run).
PRE_NAMES = ("smollm", "qwen2", "llama-bpe", "gpt-2")
# Texts whose splits tell those apart: digit runs, contractions, letters beyond ASCII, runs of spaces and newlines.
PROBES = ("Hello world! 12345 apples, 7 pears.", "I'm sure they'll've it's   three   spaces\n\n\tand\r\nCRLF",
          "Ünïcode 中文字 émoji 🙂 naïve_snake_case x=3.14159", "  leading spaces and trailing  ", "123456789 1 22 333")
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# SpecialVocab warns of post-processor shapes it only half parses (a BOS between pair sequences); what export needs
# of it, whether BOS comes first, is measured instead (_adds_bos).
logging.getLogger("gguf.vocab").setLevel(logging.ERROR)


@dataclass(frozen=True)
class HFVocab:
    """What the GGUF's tokenizer.ggml.* keys say, read from tokenizer.json."""

    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]
    types: list[int]
    scores: Optional[list[float]]  # "llama" only
    add_space_prefix: bool  # "llama" only: a "▁" before the text
    add_bos: bool  # the tokenizer puts BOS before a text (what its post-processor does)
    unk: Optional[int] = None  # the BPE's unknown token, which tokenizer.json need not list among added tokens


def read_hf_vocab(model_dir: Path, rows: int) -> HFVocab:
    """The vocabulary of `model_dir`'s tokenizer.json, padded to the embedding's `rows`, or a one-line refusal."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ExportError(f"{model_dir} has no tokenizer.json: the GGUF's tokenizer is built from it")
    spec = json.loads(path.read_text())
    tokenizer = Tokenizer.from_file(str(path))
    model = spec.get("model", {})
    kind = _kind(spec)
    tokens, types = _tokens(model.get("vocab", {}), spec.get("added_tokens", []), rows, model.get("unk_token"), kind)
    if kind == "gpt2":
        return HFVocab(kind, _pre_name(tokenizer), tokens, types, None, False, _adds_bos(tokenizer))
    unk = tokens.index(model["unk_token"]) if model.get("unk_token") in tokens else None
    return HFVocab(kind, "default", tokens, types, _merge_scores(tokens, model.get("merges", [])),
                   _space_prefix(tokenizer), _adds_bos(tokenizer), unk)


def _kind(spec: dict[str, Any]) -> str:
    model, decoder = spec.get("model") or {}, spec.get("decoder") or {}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and decoder.get("type") == "ByteLevel":
        return "gpt2"
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return "llama"
    raise ExportError(f"tokenizer.json holds a {model.get('type')} model (byte fallback: {bool(model.get('byte_fallback'))}"
                      f", decoder: {decoder.get('type')}); llama.cpp reads byte-level BPE or SentencePiece-style BPE with "
                      "byte fallback, so no GGUF can carry it")


def _tokens(vocab: dict[str, int], added: list[dict[str, Any]], rows: int, unk: Optional[str],
            kind: str) -> tuple[list[str], list[int]]:
    """Tokens in id order with their llama.cpp types; ids with no token, up to `rows`, as convert_hf_to_gguf pads."""
    by_id = {index: token for token, index in vocab.items()} | {item["id"]: item["content"] for item in added}
    if by_id and max(by_id) >= rows:
        raise ExportError(f"tokenizer.json has token id {max(by_id)}, past the embedding's {rows} rows")
    special = {item["id"]: bool(item.get("special")) for item in added}
    tokens, types = [], []
    for index in range(rows):
        token = by_id.get(index)
        tokens.append(f"[PAD{index}]" if token is None else token)
        types.append(int(_token_type(token, special.get(index), unk, kind)))
    return tokens, types


def _token_type(token: Optional[str], special: Optional[bool], unk: Optional[str], kind: str) -> TokenType:
    if token is None:
        return TokenType.UNUSED
    if kind == "llama" and token == unk:
        return TokenType.UNKNOWN
    if special is not None:  # an added token: the tokenizer matches it whole, before BPE, as llama.cpp does these two
        return TokenType.CONTROL if special else TokenType.USER_DEFINED
    if kind == "llama" and _BYTE_PIECE.fullmatch(token):
        return TokenType.BYTE
    return TokenType.NORMAL


def _pre_name(tokenizer: Any) -> str:
    """The llama.cpp pre-tokenizer whose splits of PROBES are the tokenizer's own, or a refusal."""
    if tokenizer.normalizer is not None and type(tokenizer.normalizer).__name__ != "NFC":  # Qwen's NFC: ASCII-neutral
        raise ExportError(f"tokenizer.json normalizes text ({type(tokenizer.normalizer).__name__}), which llama.cpp's "
                          "byte-level BPE does not")
    if tokenizer.pre_tokenizer is None:
        raise ExportError("tokenizer.json has no pre-tokenizer, and llama.cpp's byte-level BPE needs one it knows")
    ours = [_splits(tokenizer.pre_tokenizer, text) for text in PROBES]
    for name in PRE_NAMES:
        if [_splits(byte_level_pre_tokenizer(name), text) for text in PROBES] == ours:
            return name
    raise ExportError(f"tokenizer.json splits text unlike any pre-tokenizer export knows ({', '.join(PRE_NAMES)}): "
                      "llama.cpp would tokenize it differently")


def _splits(pre_tokenizer: Any, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def _space_prefix(tokenizer: Any) -> bool:
    """Whether text gets a leading "▁", from what the normalizer does: spaces as "▁" is all llama.cpp's can do."""
    if tokenizer.pre_tokenizer is not None:
        raise ExportError("tokenizer.json splits text before its SentencePiece-style BPE, which llama.cpp does not")
    normalized = [tokenizer.normalizer.normalize_str(text) if tokenizer.normalizer else text for text in PROBES]
    for prefix in (False, True):
        if normalized == [(SPACE if prefix else "") + text.replace(" ", SPACE) for text in PROBES]:
            return prefix
    raise ExportError("tokenizer.json's normalizer does more than turn spaces into '▁', which llama.cpp cannot")


def _merge_scores(tokens: list[str], merges: list[Any]) -> list[float]:
    """Minus the rank of the first merge that makes each piece; 0 for pieces no merge makes (characters, bytes,
    specials: llama.cpp never joins into them), as llama.cpp's converter scores padding below all."""
    index = {token: i for i, token in enumerate(tokens)}
    scores = [-10000.0 if token.startswith("[PAD") else 0.0 for token in tokens]
    made: set[int] = set()
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        target = index.get(left + right)
        if target is not None and target not in made:
            made.add(target)
            scores[target] = -float(rank + 1)
    return scores


def _adds_bos(tokenizer: Any) -> bool:
    """Whether encoding a text puts a token before it (llama.cpp's add_bos_token), measured rather than parsed."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    return tokenizer.encode("a", add_special_tokens=True).ids[:len(plain)] != plain


def add_vocab(writer: GGUFWriter, vocab: HFVocab, model_dir: Path) -> None:
    """The tokenizer.ggml.* keys and the chat template."""
    writer.add_tokenizer_model(vocab.kind)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
        writer.add_add_space_prefix(vocab.add_space_prefix)
    special = SpecialVocab(model_dir, load_merges=vocab.kind == "gpt2", n_vocab=len(vocab.tokens))
    # What the tokenizer does, not what a config says (transformers 5 writes no add_bos_token): llama.cpp defaults it
    # by pre-tokenizer (on for Llama 3's), so it is always written.
    special.add_special_token["bos"] = vocab.add_bos
    if vocab.unk is not None:
        special.special_token_ids.setdefault("unk", vocab.unk)
    special.add_to_gguf(writer, quiet=True)
