"""A SentencePiece BPE vocabulary from a GGUF ('llama' tokenizer model: Gemma, Llama 2) as a `tokenizers` BPE.

The file has pieces, scores and types but no merges. llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm)
starts from single characters and repeatedly joins the adjacent pair whose joined text is the piece with the
highest score, leftmost first; a character with no piece falls back to its UTF-8 bytes (<0xNN>). A BPE whose
merges are every split of every piece, ranked by that piece's score, joins the same pairs in the same order.
The rest is Gemma's own tokenizer.json: spaces as "▁" (with a leading one if the file asks), no pre-split,
and a decoder that turns "▁" back into spaces and bytes back into characters.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

SPACE = "\u2581"
_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL: the only pieces BPE joins into


def spm_merges(tokens: list[str], types: list[int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece into two pieces, best-scoring joined piece first."""
    index = {token: i for i, token in enumerate(tokens)}
    negated = (-scores.astype(np.float64)).tolist()  # Python floats: indexing numpy per piece cost seconds
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, token in enumerate(tokens):
        if types[i] != _NORMAL or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append((negated[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


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
