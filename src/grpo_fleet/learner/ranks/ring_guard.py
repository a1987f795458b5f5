"""The ranks proving they belong to the run, and checking what they received, before and over MLX's ring.

1. Before the ring forms: a ring on a public address, or beyond this machine
   without keys, is refused (`check_ring_network`) unless
   `distributed.trusted_network`.
2. At rank 0's CURVE ring door (protocol/ring_door.py), each other rank shows an
   allowed key and gets the run's fresh ring secret; it trusts the door only
   because it answers to the learner's public key.
3. Over the ring, every rank shows it holds the secret (`prove_ring`): a process
   that took a rank's port without coming through the door is refused there, by
   rank 0 and by the other ranks, before anything of the run is shared.
4. The run config, the shared state and every step header carry an HMAC keyed
   with the secret, which each other rank checks before it uses them (a header's
   fields before anything is allocated for the batch they announce).
5. What each rank adds (its gradients, its rows of a grid) is all-gathered with
   a tag of its own, checked by every other rank before the sum (`gather_checked`).
MPI and JACCL ranks meet at no door, so they start only on a network declared
trusted (`check_backend`).
Without keys (a ring on loopback, or a trusted network) the key is b"": the same
steps run, so the ranks still catch a stray process that speaks no protocol.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.config import DistributedConfig, RunConfig
from grpo_fleet.learner.ranks.collectives import Packed, RankGroup, launched_backend, ring_hostfile
from grpo_fleet.learner.ranks.ring_trust import (
    NONCE_WORDS,
    TAG_WORDS,
    RingRefused,
    as_words,
    check_ring_network,
    failed_proofs,
    host_of,
    nonce_slots,
    payload_tag,
    proof_slots,
    row_slots,
    tag,
)
from grpo_fleet.learner.ranks.sharding import weights_digest
from grpo_fleet.runtime.trees import flat_leaves

log = logging.getLogger("grpo_fleet.learner.ranks")
SECRET_BYTES = 32


def check_network(cfg: DistributedConfig, *, authenticated: bool) -> Optional[list[list[str]]]:
    """Before connecting: the ring's hostfile, refused (RingRefused) on an untrusted network."""
    hosts = ring_hostfile(cfg, os.environ)
    if hosts is not None:
        check_ring_network([a for rank in hosts for a in rank], authenticated=authenticated,
                           trusted=cfg.trusted_network)
    return hosts


def check_backend(cfg: DistributedConfig) -> None:
    """Connected, before anything of the run is shared: MPI and JACCL ranks meet at no ring door and name no
    addresses to judge, so they share no ring secret (their tags would be keyed with b""): refused (RingRefused)
    unless their network is declared trusted."""
    backend = launched_backend(cfg.backend, os.environ)
    if backend != "ring" and not cfg.trusted_network:
        raise RingRefused(f"the {backend} backend has no ring door and no network check, so its ranks share no ring "
                          "secret; set distributed.trusted_network = true if their network is yours alone, or use "
                          "the ring backend (mlx.launch --backend ring) with keys")


def rank0_host(cfg: DistributedConfig) -> Optional[str]:
    """Rank 0's first ring address's host, where its ring door and doorbell listen; None off the ring backend."""
    hosts = ring_hostfile(cfg, os.environ)
    return host_of(hosts[0][0]) if hosts and hosts[0] else None


def door_endpoint(cfg: DistributedConfig) -> Optional[str]:
    """Rank 0's ring door: `rank0_host` at `door_port`; None off the ring backend."""
    host = rank0_host(cfg)
    if host is None:
        return None
    return f"tcp://[{host}]:{cfg.door_port}" if ":" in host else f"tcp://{host}:{cfg.door_port}"


def admit_ranks(ranks: RankGroup, cfg: RunConfig) -> None:
    """Rank 0, before anything of the run is shared: the door (with keys), then every rank's proof over the ring."""
    endpoint = door_endpoint(cfg.distributed)
    if cfg.security.keys_dir and endpoint is not None:
        from grpo_fleet.protocol.ring_door import DoorClosed, open_door
        from grpo_fleet.protocol.sockets import AddressInUse

        ranks.ring_key = secrets.token_bytes(SECRET_BYTES)
        try:
            ranks.refusals.update(open_door(cfg.security.keys_dir, endpoint, ranks.size, ranks.ring_key,
                                            cfg.distributed.idle_timeout_seconds))
        except DoorClosed as exc:
            raise RingRefused(f"rank 0: refused the ring: {exc}") from None
        except AddressInUse as exc:
            raise RingRefused(f"rank 0: cannot open the ring door: {exc}; choose distributed.door_port") from None
        except (OSError, ValueError) as exc:  # no learner key in keys_dir, or not a key
            raise RingRefused(f"rank 0: cannot open the ring door: {exc}") from None
    else:
        log.warning("rank 0: the ranks are not authenticated (%s); see docs/data-parallel.md, 'Who may join the ring'",
                    "no security.keys_dir" if endpoint else "the ring door covers the ring backend only")
    failed = prove_ring(ranks)
    if failed:
        ranks.refusals["ring proof failed"] += len(failed)
        raise RingRefused(f"rank 0: refused the ring: rank(s) {', '.join(map(str, failed))} did not prove they hold "
                          "this run's ring secret (a process that is not a rank of this run holds their place in the "
                          "ring); nothing of the run was shared")
    log.info("rank 0: all %d ranks proved they belong to the run", ranks.size)


def enter_ring(ranks: RankGroup) -> None:
    """A rank other than 0: the ring secret from rank 0's door (with keys), then the proofs over the ring."""
    cfg, endpoint = ranks.cfg, door_endpoint(ranks.cfg)
    if cfg.key_file and cfg.learner_key_file and endpoint is not None:
        from grpo_fleet.protocol.ring_door import DoorClosed, knock

        try:
            ranks.ring_key = knock(endpoint, cfg.key_file, cfg.learner_key_file, ranks.rank, cfg.idle_timeout_seconds)
        except DoorClosed as exc:
            raise RingRefused(f"rank {ranks.rank}: refused rank 0: {exc}") from None
        except (OSError, ValueError) as exc:  # a key file missing or not a key
            raise RingRefused(f"rank {ranks.rank}: cannot read its ring keys: {exc}") from None
        log.info("rank %d: authenticated at rank 0's ring door %s", ranks.rank, endpoint)
    failed = prove_ring(ranks)
    if failed:
        raise RingRefused(f"rank {ranks.rank}: refused the ring: rank(s) {', '.join(map(str, failed))} did not prove "
                          "they hold this run's ring secret" + (" (rank 0 is not this run's learner)" if 0 in failed
                                                                else ""))


def prove_ring(ranks: RankGroup) -> list[int]:
    """Every rank's nonce gathered, then every rank's HMAC over them: the ranks whose HMAC is wrong."""
    slots = nonce_slots(ranks.rank, ranks.size, secrets.token_bytes(4 * NONCE_WORDS))
    nonces = ranks.gather_slots(slots, "ring proof (nonces)", idle=True)
    tags = ranks.gather_slots(proof_slots(ranks.ring_key, ranks.rank, nonces), "ring proof (tags)",
                             idle=True)
    return failed_proofs(ranks.ring_key, nonces, tags)


def send_signed(ranks: RankGroup, data: bytes, what: str) -> None:
    """Rank 0: `data` on every rank, and its HMAC after it."""
    ranks.broadcast_bytes(data, what, idle=True)
    ranks.broadcast([mx.array(as_words(tag(ranks.ring_key, what, data)))], f"{what} (tag)", idle=True)


def receive_signed(ranks: RankGroup, what: str) -> bytes:
    """The others: rank 0's `data`, refused (RingRefused) unless its HMAC holds."""
    data = ranks.broadcast_bytes(b"", what, idle=True)
    (words,) = ranks.broadcast([mx.zeros(TAG_WORDS, dtype=mx.int32)], f"{what} (tag)", idle=True)
    if not hmac.compare_digest(np.array(words).tobytes(), tag(ranks.ring_key, what, data)):
        ranks.refusals["bad tag"] += 1
        raise RingRefused(f"rank {ranks.rank}: the {what} failed its HMAC: altered on the way, or not from rank 0")
    return data


def state_tag(ranks: RankGroup, weights: Any, optimizer_state: Any) -> bytes:
    """HMAC over the digests of the trainable weights and the optimizer state."""
    parts = [weights_digest({name: value for name, value in flat_leaves(tree) if isinstance(value, mx.array)}).tobytes()
             for tree in (weights, optimizer_state)]
    return tag(ranks.ring_key, "shared state", *parts)


def check_state(ranks: RankGroup, weights: Any, optimizer_state: Any) -> None:
    """After share_state: rank 0 sends its state's HMAC, the others compare it with their own state's."""
    mine = state_tag(ranks, weights, optimizer_state)
    (words,) = ranks.broadcast([mx.array(as_words(mine))], "shared state (tag)", idle=True)
    if ranks.rank != 0 and not hmac.compare_digest(np.array(words).tobytes(), mine):
        ranks.refusals["bad tag"] += 1
        raise RingRefused(f"rank {ranks.rank}: the weights or optimizer state received differ from rank 0's (HMAC of "
                          "their digests): altered on the way, or not from rank 0")


def gather_checked(ranks: RankGroup, arrays: list[mx.array], what: str) -> list[list[mx.array]]:
    """Every rank's `arrays` by rank (this rank's own as they are), each other rank's refused (RingRefused) unless
    the tag it sent with them holds: MLX's all-gather carries them in clear."""
    counter = ranks.gathers
    ranks.gathers += 1
    mine = payload_tag(ranks.ring_key, what, counter, ranks.rank, [wire_view(a) for a in arrays])
    tags = ranks.gather_slots(row_slots(ranks.rank, ranks.size, mine), f"{what} (tags)")
    pieces = ranks.gather(arrays, what)
    pieces[ranks.rank] = arrays
    forged = [rank for rank in range(ranks.size) if rank != ranks.rank and not hmac.compare_digest(
        np.ascontiguousarray(tags[rank], np.int32).tobytes(),
        payload_tag(ranks.ring_key, what, counter, rank, [wire_view(a) for a in pieces[rank]]))]
    if forged:
        ranks.refusals["bad tag"] += 1
        raise RingRefused(f"rank {ranks.rank}: the {what} from rank(s) {', '.join(map(str, forged))} failed its HMAC: "
                          "altered on the way, or not from a rank of this run")
    return pieces


def checked_sum(ranks: RankGroup, tree: Any, what: str) -> Any:
    """The tree (of arrays) summed over the ranks from their checked contributions (`gather_checked`), in rank
    order on every rank, so every rank gets the same bits; one bucket at a time, so the ranks' copies of one
    bucket are held at once, not of the whole tree."""
    packed = Packed(tree)
    sums = []
    for flat in packed.flats:
        pieces = gather_checked(ranks, [flat], what)
        total = pieces[0][0]
        for (piece,) in pieces[1:]:
            total = total + piece
        mx.eval(total)
        sums.append(total)
    return packed.unpack(sums)


def wire_view(array: mx.array) -> np.ndarray:
    """An array's bytes as they travel, for a tag (bfloat16, which NumPy has not, as its 16-bit words)."""
    return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
