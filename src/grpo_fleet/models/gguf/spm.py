"""A SentencePiece BPE vocabulary from a GGUF ('llama' tokenizer model: Gemma, Llama 2) as a `tokenizers` BPE.

The file has pieces, scores and types but no merges. llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm)
starts from single characters and repeatedly joins the adjacent pair whose joined text is the piece with the
highest score, leftmost first; a character with no piece falls back to its UTF-8 bytes (<0xNN>). A BPE whose
merges are every split of every piece, ranked by that piece's score, joins the same pairs in the same order.
The rest is Gemma's own tokenizer.json: spaces as "▁" (with a leading one if the file asks), no pre-split,
and a decoder that turns "▁" back into spaces and bytes back into characters.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional

import numpy as np

from grpo_fleet.models.gguf.metadata import GGUFError

SPACE = "\u2581"
_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL: the only pieces BPE joins into
# A normal piece of L characters is walked at its L - 1 split points, and each split that is a merge holds L
# characters: a vocabulary of pieces that extend each other ("a", "aa", "aaa", ...) makes both grow with the cube of
# its size (1,200 such pieces in Gemma 3's file took import-gguf from 0.62 to 4.7 GB). Both are held to a multiple of
# the vocabulary's own characters, plus a floor for a small one. Real vocabularies stay well inside: Gemma 3's 262,144
# pieces (1.48 M characters) walk 9.9 M characters (6.7 per character) and keep 3.1 M in merges (2.1 per character).
SPLIT_WORK_PER_CHAR = 16
MERGE_CHARS_PER_CHAR = 6  # ~25 bytes of import memory each (Python, tokenizers, tokenizer.json): +170 MB for Gemma's
BOUND_FLOOR = 1 << 20


def _refused(what: str, amount: int, bound: int) -> GGUFError:
    return GGUFError(f"the SentencePiece vocabulary's pieces would make {amount:,} characters of {what} (at most "
                     f"{bound:,} for its size): pieces that extend each other, refused")


def check_split_work(tokens: list[str], types: list[int]) -> None:
    """Refuse, before a split is walked, a vocabulary whose split points would cost more than the bound above."""
    work = sum(len(token) ** 2 for token, kind in zip(tokens, types) if kind == _NORMAL)
    bound = SPLIT_WORK_PER_CHAR * sum(len(token) for token in tokens) + BOUND_FLOOR
    if work > bound:
        raise _refused("split points", work, bound)


def _splits(tokens: list[str], types: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(piece, cut) of every split of a normal piece into two pieces; refused once their merges would hold more
    characters than the bound above, before any of them is built."""
    check_split_work(tokens, types)
    index = set(tokens)
    bound = MERGE_CHARS_PER_CHAR * sum(len(token) for token in tokens) + BOUND_FLOOR
    pieces, cuts, held = array("q"), array("q"), 0  # 16 bytes a split until they are ranked
    for i, token in enumerate(tokens):
        if types[i] != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            if token[:cut] in index and token[cut:] in index:
                pieces.append(i)
                cuts.append(cut)
                held += len(token)
        if held > bound:
            raise _refused("merges", held, bound)
    return np.frombuffer(pieces, dtype=np.int64), np.frombuffer(cuts, dtype=np.int64)


def spm_merges(tokens: list[str], types: list[int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece into two pieces, best-scoring joined piece first."""
    found, at = _splits(tokens, types)
    # Best score first; ties by piece, then by cut (leftmost first).
    order = np.lexsort((at, found, -scores.astype(np.float64)[found]))
    return [(tokens[i][:cut], tokens[i][cut:]) for i, cut in zip(found[order].tolist(), at[order].tolist())]


def sentencepiece_tokenizer(tokens: list[str], types: list[int], scores: np.ndarray, *, add_space_prefix: bool,
                            unk: Optional[str]) -> Any:
    """The BPE `tokenizers.Tokenizer` equivalent to llama.cpp's SentencePiece tokenization of this vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    bpe = models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=spm_merges(tokens, types, scores),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # mlx-lm picks its SentencePiece streaming detokenizer from exactly these decoder shapes.
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    return tokenizer
