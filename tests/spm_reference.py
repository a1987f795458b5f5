"""Google's `sentencepiece` as the reference for SentencePiece vocabularies read from a GGUF.

llama.cpp's converter writes a SentencePiece model's pieces, scores and types into the GGUF; this puts them back
into a SentencePiece ModelProto (BPE, byte fallback, no normalization rules) so that the library the vocabulary
came from tokenizes text with it, independently of `grpo_fleet.models.gguf.spm`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

SPACE = "\u2581"


def sentencepiece_processor(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], *,
                            add_dummy_prefix: bool, unk_id: Optional[int]) -> Any:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.unk_id = -1 if unk_id is None else unk_id
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for index, (token, kind, score) in enumerate(zip(tokens, types, scores)):
        piece = proto.pieces.add()
        # llama.cpp writes a user-defined piece's "▁" as a space (its tokenizer matches those on the raw text).
        piece.piece = token.replace(" ", SPACE) if kind == 4 else token
        piece.score = float(score)
        piece.type = pb.ModelProto.SentencePiece.UNKNOWN if index == unk_id else (kind if kind in (1, 3, 4, 5, 6) else 1)
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(proto.SerializeToString())
    return processor
