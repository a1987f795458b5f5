"""The pure side of the data-parallel learner: which rows each rank trains, the step header, the weights' digest.

No collectives here (learner/ranks/collectives.py does those): rows in, rows out, so
every rule the ranks must agree on is testable without processes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from enum import IntEnum

import mlx.core as mx
import numpy as np

from grpo_fleet.runtime.trees import flat_leaves

HEADER_SIZE = 13  # int32 slots of the command rank 0 broadcasts before each step: 5 fields, 2 tags of 4
DIGEST_WORDS = 4  # int32 words of the weights' digest the ranks compare
MAX_CHECK_VERSIONS = 64  # versions whose weights one step's header may announce (far above any staleness kept)


class Command(IntEnum):
    """What rank 0 tells the other ranks to do next."""

    STEP = 1  # a TrainBatch of the header's shape follows; train on your rows of it
    STOP = 2  # the run is over (or rank 0 was asked to stop): exit 0
    KEEPALIVE = 3  # rank 0 is alive, waiting for a batch; wait again


@dataclass(frozen=True)
class Header:
    """Rank 0's next command and, for a step, the batch's shape."""

    command: Command
    rows: int = 0
    width: int = 0
    num_groups: int = 0
    tag: bytes = b""  # 16 bytes of HMAC (ring_trust.header_tag) over the fields and the batch; b"" unsigned
    versions: int = 0  # a step's older versions whose weights follow the batch, to recompute groups at (step/recheck.py)
    # 16 bytes of HMAC over the fields alone: checked before anything is allocated for the batch they announce.
    head_tag: bytes = b""

    def encode(self) -> np.ndarray:
        out = np.zeros(HEADER_SIZE, dtype=np.int32)
        out[:5] = [int(self.command), self.rows, self.width, self.num_groups, self.versions]
        for start, tag in ((5, self.head_tag), (9, self.tag)):
            if tag:
                out[start:start + 4] = np.frombuffer(tag, dtype=np.int32)
        return out

    def unsigned(self) -> np.ndarray:
        """The words its tags cover: the fields, no tag."""
        return replace(self, tag=b"", head_tag=b"").encode()

    @classmethod
    def decode(cls, words: np.ndarray) -> "Header":
        if words.shape != (HEADER_SIZE,):
            raise ValueError(f"a step header has {HEADER_SIZE} int32 words, got shape {words.shape}")
        command, rows, width, groups, versions = (int(w) for w in words[:5])
        if min(rows, width, groups) < 0 or not 0 <= versions <= MAX_CHECK_VERSIONS:
            raise ValueError(f"a step header announces {rows} x {width} rows of {groups} groups and {versions} "
                             f"versions' weights (none negative, at most {MAX_CHECK_VERSIONS} versions)")
        head_tag, tag = (np.ascontiguousarray(words[i:i + 4], np.int32).tobytes() if words[i:i + 4].any() else b""
                         for i in (5, 9))  # zeros: unsigned
        return cls(Command(command), rows, width, groups, tag=tag, versions=versions, head_tag=head_tag)


def shard_rows(total: int, rank: int, size: int) -> np.ndarray:
    """The batch rows rank `rank` of `size` trains: rank, rank + size, ... (each rank gets a fair share).

    Strided rather than contiguous, so each rank's rows mix long and short
    completions and the ranks finish their micro-batches at about the same time.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    check_rows_cover_ranks(total, size)
    return np.arange(rank, total, size)


def check_rows_cover_ranks(total: int, size: int) -> None:
    """Refuse a batch with fewer rows than ranks: a rank with no rows would have no gradients to add."""
    if total < size:
        raise ValueError(
            f"a batch of {total} sequences cannot be split over {size} learner ranks (each needs at least one); "
            "raise grpo.groups_per_step or generation.group_size, or run fewer ranks"
        )


def buckets(sizes: list[int], kinds: list[str], limit: int) -> list[list[int]]:
    """Indices of arrays grouped for one collective each: the same dtype (`kinds`), at most `limit` bytes.

    One all-sum per weight would pay the ring's latency hundreds of times a
    step; one per dtype would copy every gradient at once. An array over the
    limit gets a bucket of its own.
    """
    out: list[list[int]] = []
    open_bucket: dict[str, tuple[list[int], int]] = {}
    for index, (size, kind) in enumerate(zip(sizes, kinds)):
        members, used = open_bucket.get(kind, ([], 0))
        if members and used + size > limit:
            out.append(members)
            members, used = [], 0
        open_bucket[kind] = (members + [index], used + size)
    out.extend(members for members, _ in open_bucket.values())
    return sorted(out)


def weights_digest(tree: dict) -> np.ndarray:
    """`DIGEST_WORDS` int32 words of a hash over every array of `tree` (names, dtypes, shapes and bytes).

    Ranks compare it with an all-max and an all-min: equal only if every rank's
    weights are bitwise the same.
    """
    digest = hashlib.blake2b(digest_size=4 * DIGEST_WORDS)
    for name, value in sorted(flat_leaves(tree), key=lambda pair: pair[0]):
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(np.asarray(value.astype(mx.float32) if value.dtype == mx.bfloat16 else value).tobytes())
    return np.frombuffer(digest.digest(), dtype=np.int32).copy()
