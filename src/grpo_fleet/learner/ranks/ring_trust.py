"""The pure side of trusting the ring: which addresses it may use, and the HMACs the ranks prove themselves with.

MLX's ring carries everything in clear and accepts whoever connects first. So
the ranks first meet at rank 0's CURVE "ring door" (protocol/ring_door.py),
where each follower gets the run's ring secret; then over the ring every rank
shows it knows the secret (`proof_tag` over every rank's nonce), every
message rank 0 sends (the run config, the shared state, each step's header and
batch) carries an HMAC keyed with it, and so does what each rank adds to a
gather (its gradients, its rows of a grid: `payload_tag`). Nothing here opens a
socket: bytes in, verdicts out.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from typing import Iterable

import blake3
import numpy as np

NONCE_WORDS = 8  # int32 words of each rank's nonce in the proof
TAG_WORDS = 8  # int32 words of a full HMAC-SHA256 tag
HEADER_TAG_WORDS = 4  # int32 words of the truncated tag a step header carries (128 bits)
PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))


class RingRefused(RuntimeError):
    """The ring cannot be trusted: a rank did not prove it belongs to the run, or a message failed its HMAC."""


def hostfile_addresses(text: str) -> list[list[str]]:
    """The ring hostfile's `ip:port` entries, one list per rank (mlx.launch's MLX_HOSTFILE format)."""
    ranks = json.loads(text)
    if not isinstance(ranks, list) or not all(isinstance(r, list) and all(isinstance(a, str) for a in r)
                                              for r in ranks):
        raise ValueError("a ring hostfile is a JSON list of lists of 'ip:port' strings")
    return ranks


def host_of(address: str) -> str:
    """'10.0.0.2:32323' -> '10.0.0.2'; '[fe80::1]:32323' -> 'fe80::1'."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def network_kind(host: str) -> str:
    """'loopback', 'private' (RFC 1918, ULA, link-local) or 'public' (anything else, names included)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 zone (fe80::1%en0) names the interface
    except ValueError:
        return "public"  # a name may resolve anywhere: judge it as the worst case
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local or any(ip in network for network in PRIVATE_NETWORKS):
        return "private"
    return "public"


def check_ring_network(addresses: Iterable[str], *, authenticated: bool, trusted: bool) -> None:
    """Refuse a ring on a public address, or one beyond this machine without keys, unless the network is trusted."""
    kinds = {address: network_kind(host_of(address)) for address in addresses}
    public = [a for a, kind in kinds.items() if kind == "public"]
    if public and not trusted:
        raise RingRefused(
            f"the ring hostfile names non-private addresses ({', '.join(public)}); the ring carries the weights and "
            "batches in clear and accepts whoever connects first. Use loopback, RFC 1918, ULA or link-local "
            "addresses, or set distributed.trusted_network = true if this network is yours alone")
    beyond = [a for a, kind in kinds.items() if kind != "loopback"]
    if beyond and not authenticated and not trusted:
        raise RingRefused(
            f"a ring beyond this machine ({', '.join(beyond)}) needs keys: security.keys_dir on rank 0 and "
            "distributed.key_file + distributed.learner_key_file on the others (`grpo-fleet keys add-rank`), "
            "or distributed.trusted_network = true")


def tag(secret: bytes, purpose: str, *parts: bytes) -> bytes:
    """HMAC-SHA256 keyed with the ring secret over `purpose` and the length-prefixed parts (no ambiguous joins)."""
    mac = hmac.new(secret, purpose.encode(), hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def as_words(data: bytes) -> np.ndarray:
    """Bytes as the int32 words they travel in over an all-sum."""
    return np.frombuffer(data, dtype=np.int32).copy()


def row_slots(rank: int, size: int, data: bytes) -> np.ndarray:
    """A `[size, words]` grid of zeros with this rank's `data` in its row: summed over ranks, everyone's."""
    slots = np.zeros((size, len(data) // 4), dtype=np.int32)
    slots[rank] = as_words(data)
    return slots


def nonce_slots(rank: int, size: int, nonce: bytes) -> np.ndarray:
    """A `[size, NONCE_WORDS]` grid of zeros with this rank's nonce in its row: summed over ranks, everyone's."""
    return row_slots(rank, size, nonce)


def payload_tag(secret: bytes, purpose: str, counter: int, rank: int, arrays: Iterable[np.ndarray]) -> bytes:
    """Rank `rank`'s tag over what it adds to the `counter`-th gather of the run (its gradients, its rows of a
    grid): keyed BLAKE3, which hashes gradients on every core, keyed from the ring secret, and bound to the
    purpose, the gather's number and the rank, so a peer in the middle can neither alter, replay nor swap them."""
    key = hmac.new(secret, b"payload key", hashlib.sha256).digest()
    mac = blake3.blake3(key=key, max_threads=blake3.blake3.AUTO)
    for part in (purpose.encode(), counter.to_bytes(8, "little"), rank.to_bytes(4, "little")):
        mac.update(len(part).to_bytes(8, "little") + part)
    for array in arrays:
        array = np.ascontiguousarray(array)
        kind = f"{array.dtype}:{array.shape}".encode()
        mac.update(len(kind).to_bytes(8, "little") + kind + array.nbytes.to_bytes(8, "little"))
        mac.update(array.reshape(-1).view(np.uint8).data)
    return mac.digest()


def proof_tag(secret: bytes, rank: int, nonces: np.ndarray) -> bytes:
    """Rank `rank`'s proof that it holds the secret, bound to every rank's fresh nonce (no replay from another run)."""
    return tag(secret, "ring proof", rank.to_bytes(4, "little"), np.ascontiguousarray(nonces, np.int32).tobytes())


def proof_slots(secret: bytes, rank: int, nonces: np.ndarray) -> np.ndarray:
    slots = np.zeros((nonces.shape[0], TAG_WORDS), dtype=np.int32)
    slots[rank] = as_words(proof_tag(secret, rank, nonces))
    return slots


def failed_proofs(secret: bytes, nonces: np.ndarray, tags: np.ndarray) -> list[int]:
    """The ranks whose slot of the gathered `tags` is not their proof over the gathered `nonces`."""
    return [rank for rank in range(nonces.shape[0])
            if not hmac.compare_digest(np.ascontiguousarray(tags[rank], np.int32).tobytes(),
                                       proof_tag(secret, rank, nonces))]


def header_tag(secret: bytes, sequence: int, words: np.ndarray, arrays: Iterable[np.ndarray],
               purpose: str = "step header") -> np.ndarray:
    """The `HEADER_TAG_WORDS` words of a step header's tag: its number in the run, its fields, and the batch it
    announces, so a peer in the middle of the ring can neither alter, replay nor reorder a batch unseen (a
    header carries two: its fields' alone, as `purpose` "step command", and with its batch)."""
    parts = [sequence.to_bytes(8, "little"), np.ascontiguousarray(words, np.int32).tobytes()]
    parts += [f"{a.dtype}:{a.shape}".encode() + np.ascontiguousarray(a).tobytes() for a in arrays]
    return as_words(tag(secret, purpose, *parts)[: 4 * HEADER_TAG_WORDS])
