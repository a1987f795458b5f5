"""msgpack envelope around the pydantic messages, hardened for untrusted input.

Wire format: a msgpack map `{"v": PROTOCOL_VERSION, "type": <class name>,
"body": <model_dump()>}`; bytes fields travel as msgpack bin (no base64).
`decode` raises only `ProtocolError`, whose `reason` is a fixed short label so
the learner can answer the peer and count failures by kind. Every reason but
`internal` is the sender's doing; `internal` is a bug on this side (a validator
that raised instead of refusing), carries the exception as its `__cause__`, and
must never be charged to the peer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgpack
from pydantic import BaseModel, ValidationError

from grpo_fleet.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION
from grpo_fleet.protocol.reasons import RejectReason

MiB = 1024 * 1024

INTERNAL = RejectReason.INTERNAL.value
REASONS = frozenset({"too_large", "malformed", "bad_version", "unknown_type", "invalid", "too_deep", "bad_frames",
                     INTERNAL})

_ENVELOPE_KEYS = frozenset({"v", "type", "body"})
_SCALARS = (str, bytes, int, float, bool, type(None))
# msgpack reports its own length limits as ValueError("N exceeds max_bin_len(M)").
_LENGTH_LIMIT = re.compile(r"exceeds max_(bin|str|array|map)_len")

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class Limits:
    """Upper bounds applied while decoding one message."""

    max_message_bytes: int = 64 * MiB
    max_bin_len: int = 64 * MiB
    max_str_len: int = 1 * MiB
    max_array_len: int = 100_000
    max_map_len: int = 1024
    max_depth: int = 16
    # A Rollouts answers one lease, so the learner refuses more groups (or more
    # completions per group) than a lease can hold before pydantic walks them:
    # validating 100k completions held the request loop for seconds. None = no bound.
    max_rollout_groups: Optional[int] = None
    max_group_completions: Optional[int] = None


DEFAULT_LIMITS = Limits()


class ProtocolError(Exception):
    """A message that cannot be accepted; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown protocol error reason {reason!r}")
        super().__init__(message or reason)
        self.reason = reason
        self.message = message or reason

    def __repr__(self) -> str:
        return f"ProtocolError({self.reason!r}, {self.message!r})"

    @property
    def is_violation(self) -> bool:
        """True when the sender is to blame (everything but this side's own bug)."""
        return self.reason != INTERNAL


class _ExtRejected(Exception):
    pass


def _reject_ext(code: int, data: bytes) -> Any:
    raise _ExtRejected(f"msgpack ext type {code} is not allowed")


def encode(msg: BaseModel) -> bytes:
    """Pack a top-level message into its envelope."""
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a protocol message type")
    envelope = {"v": PROTOCOL_VERSION, "type": name, "body": msg.model_dump()}
    return msgpack.packb(envelope, use_bin_type=True)


def _unpack(data: Buffer, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=limits.max_bin_len,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except msgpack.exceptions.StackError as exc:
        raise ProtocolError("too_deep", f"nesting exceeds the msgpack stack: {exc}") from None
    except ValueError as exc:
        if _LENGTH_LIMIT.search(str(exc)):
            raise ProtocolError("too_large", str(exc)) from None
        raise ProtocolError("malformed", f"{type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on foreign bytes is "malformed"
        raise ProtocolError("malformed", f"{type(exc).__name__}: {exc}") from None


def _check_tree(obj: Any, max_depth: int) -> None:
    """Iterative walk: bounded depth, str map keys and plain types only (no recursion to overflow).

    Scalars are checked where they are found instead of being pushed on the stack:
    this walk runs on every message and a Rollouts holds hundreds of them. Exact
    type checks are enough because msgpack only produces these plain types.
    """
    if type(obj) not in (dict, list):
        if not isinstance(obj, _SCALARS):
            raise ProtocolError("malformed", f"unexpected value type {type(obj).__name__}")
        return
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise ProtocolError("too_deep", f"nesting deeper than {max_depth}")
        if type(node) is dict:
            if not all(type(key) is str for key in node):
                raise ProtocolError("malformed", "map keys must be strings")
            children = node.values()
        else:
            children = node
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif not isinstance(child, _SCALARS):
                raise ProtocolError("malformed", f"unexpected value type {kind.__name__}")


def _check_rollouts_shape(body: Any, limits: Limits) -> None:
    """Count groups and completions in the unpacked body: O(groups), before any validation."""
    groups = body.get("groups") if type(body) is dict else None
    if type(groups) is not list:
        return  # not shaped like a Rollouts: pydantic gives the precise error
    unscored = body.get("unscored")
    count = len(groups) + (len(unscored) if type(unscored) is list else 0)
    if limits.max_rollout_groups is not None and count > limits.max_rollout_groups:
        raise ProtocolError("too_large", f"Rollouts: {count} groups > {limits.max_rollout_groups} per lease")
    if limits.max_group_completions is None:
        return
    for group in groups:
        completions = group.get("completions") if type(group) is dict else None
        if type(completions) is list and len(completions) > limits.max_group_completions:
            raise ProtocolError(
                "too_large", f"Rollouts: {len(completions)} completions in a group > {limits.max_group_completions}"
            )


def _summarize(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "<body>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def decode(data: Buffer, limits: Limits = DEFAULT_LIMITS) -> BaseModel:
    """Parse and validate one message; raises ProtocolError and nothing else."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise ProtocolError("malformed", f"expected a bytes-like object, got {type(data).__name__}") from None
    if size > limits.max_message_bytes:
        raise ProtocolError("too_large", f"{size} bytes > limit {limits.max_message_bytes}")
    envelope = _unpack(data, limits)
    _check_tree(envelope, limits.max_depth)
    if not isinstance(envelope, dict) or set(envelope) != _ENVELOPE_KEYS:
        raise ProtocolError("malformed", "envelope must be a map with exactly the keys v, type, body")
    version = envelope["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {version!r}, but this grpo-fleet speaks "
                            f"{PROTOCOL_VERSION}: run the same release on the learner and every actor")
    name = envelope["type"]
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError("unknown_type", f"unknown message type {str(name)[:64]!r}")
    if cls.__name__ == "Rollouts":
        _check_rollouts_shape(envelope["body"], limits)
    try:
        return cls.model_validate(envelope["body"], strict=True)
    except ValidationError as exc:
        raise ProtocolError("invalid", f"{name}: {_summarize(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - a validator bug must not escape as a crash
        # pydantic turns a validator's ValueError/AssertionError into ValidationError; anything else is our bug,
        # not the peer's: kept as the cause, for the traceback.
        raise ProtocolError(INTERNAL, f"{name}: {type(exc).__name__}: {exc}") from exc
