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

from grpo_fleet.gguf_metadata import GGUFError

SPACE = "\u2581"
_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL: the only pieces BPE joins into
# A normal piece of L characters is walked at its L - 1 split points, and each split that is a merge holds L
# characters: a vocabulary of pieces that extend each other ("a", "aa", "aaa", ...) makes both grow with the cube of
# its size (1,200 such pieces in Gemma 3's file took import-gguf from 0.62 to 4.7 GB). So the sum of L * L over the
# normal pieces is held to SPLIT_WORK_PER_CHAR per character of the whole vocabulary, plus SPLIT_WORK_FLOOR for a
# small one; real vocabularies stay well inside (Gemma 3's 262,144 pieces: 6.7 per character).
SPLIT_WORK_PER_CHAR = 16
SPLIT_WORK_FLOOR = 1 << 20


def check_split_work(tokens: list[str], types: list[int]) -> None:
    """Refuse, before any merge is built, a vocabulary whose split points would cost more than the bound above."""
    work = sum(len(token) ** 2 for token, kind in zip(tokens, types) if kind == _NORMAL)
    budget = SPLIT_WORK_PER_CHAR * sum(len(token) for token in tokens) + SPLIT_WORK_FLOOR
    if work > budget:
        raise GGUFError(f"the SentencePiece vocabulary's pieces are too long for their number ({work:,} split "
                        f"characters to walk, at most {budget:,}): pieces that extend each other, refused")


def spm_merges(tokens: list[str], types: list[int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece into two pieces, best-scoring joined piece first."""
    check_split_work(tokens, types)
    index = set(tokens)
    pieces, cuts = array("q"), array("q")  # the splits found, 16 bytes each until they are ranked
    for i, token in enumerate(tokens):
        if types[i] != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            if token[:cut] in index and token[cut:] in index:
                pieces.append(i)
                cuts.append(cut)
    found, at = np.frombuffer(pieces, dtype=np.int64), np.frombuffer(cuts, dtype=np.int64)
    # Best score first; ties by piece, then by cut (leftmost first), as the tuples were ranked before.
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
