"""Wire messages exchanged between the learner and its actors.

Every model is strict, frozen and closed (`extra="forbid"`): the learner treats
each actor as untrusted input, so nothing is coerced and unknown fields are an
error rather than silently dropped. Sequences are `list` because msgpack
decodes arrays to lists and strict mode would reject a list for a tuple field.

Only intrinsic, cheap checks live in the validators. Checks that depend on run
state (group size, vocabulary, token budget) are in `validate_rollouts`, so the
learner can report a precise reason and count it.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional, Union, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic.fields import FieldInfo

from grpo_fleet.protocol.reasons import RejectReason
from grpo_fleet.runtime.digest import blob_digest as blob_digest  # re-exported: part of the wire vocabulary

# 2: Ack carries lease_id; WeightsGone answers a GetWeights for a version no longer kept.
# 3: user reward modules (RewardSpec.module/digest), every dataset column to rewards, unscored groups,
#    eval leases (Lease.eval).
# 4: episodes (task.env): Welcome.env, PromptItem.messages, and each completion's sampled/environment mask, turn
#    starts and end; a run may name no task reward (the episode's own reward then stands alone).
PROTOCOL_VERSION = 4

TensorDType = Literal["int32", "uint32", "uint8", "float32", "float16", "bfloat16"]

# Little-endian is fixed on the wire so hosts of either byte order agree.
_NUMPY_DTYPES: dict[TensorDType, np.dtype] = {
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "uint8": np.dtype("u1"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
}
_ITEMSIZE: dict[str, int] = {"int32": 4, "uint32": 4, "uint8": 1, "float32": 4, "float16": 2, "bfloat16": 2}

# Every number on the wire is bounded, in the dtype it is used in, and the same
# types serve inbound and outbound messages: a value the learner accepts at the
# door can never make one of its own replies (Status, Heartbeat) fail to validate.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_BYTES = 2**40  # byte offsets and lengths: 1 TiB, far above any weight blob
MAX_COUNT = 2**53  # running totals: exact in a float64 (JSON, Prometheus)
MAX_SECONDS = float(2**31)  # durations: about 68 years
MAX_TIMESTAMP = float(2**34)  # unix seconds, year ~2514; finite and non-negative

# Finite floats only: NaN/inf in a config-like field is always a bug or an attack.
# Floats are bounded to float32, the dtype rewards, rates and weights end up in.
FiniteFloat = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX, allow_inf_nan=False)]
PositiveFloat = Annotated[float, Field(gt=0, le=FLOAT32_MAX, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, le=FLOAT32_MAX, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
Timestamp = Annotated[float, Field(ge=0, le=MAX_TIMESTAMP, allow_inf_nan=False)]
# Non-negative int32: tensor dimensions, prompt indices, and policy versions.
NonNegInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
Version = NonNegInt
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Port = Annotated[int, Field(ge=0, le=65535)]
Blake3Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # a 256-bit BLAKE3 digest, hex
LoraValue = Union[bool, Int32, FiniteFloat, str, list[str], None]

# Peer-supplied strings that reach logs, metrics labels and /sd: a safe character
# set, so no CR, ANSI escape or NUL can be written by a peer. Lease ids are the
# learner's uuid4 hex ("" for a no-work Lease) and group ids its "g%08d".
ACTOR_ID_CHARS = "A-Za-z0-9._:@+-"
_ACTOR_ID = rf"[A-Za-z0-9][{ACTOR_ID_CHARS}]{{0,127}}"
ACTOR_ID_PATTERN = rf"^{_ACTOR_ID}$"
ActorId = Annotated[str, Field(pattern=ACTOR_ID_PATTERN)]
OptionalActorId = Annotated[str, Field(pattern=rf"^({_ACTOR_ID})?$")]
GroupId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
LeaseId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{0,128}$")]
RunId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,128}$")]


def printable(max_length: int) -> FieldInfo:
    """Printable ASCII (space to tilde) of at most `max_length` characters."""
    return Field(pattern=rf"^[\x20-\x7e]{{0,{max_length}}}$")


Label = Annotated[str, printable(64)]
Reason = Annotated[str, printable(4096)]
# One life of a learner process: a fresh one on every start and every --resume.
# Versions up to the one a life resumed at are shared history; newer ones belong
# to the life that trained them, so the same number can mean other weights.
Incarnation = Annotated[str, Field(pattern=r"^([0-9a-f]{12})?$")]
# Sampled-token logprobs a real model can produce: finite, at most 0 (plus float
# noise), and not below this floor (a token that unlikely is never sampled).
LOGPROB_FLOOR, LOGPROB_CEILING = -1e4, 1e-4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Tensor(_Strict):
    """A dense little-endian array as raw bytes (msgpack bin, no base64)."""

    dtype: TensorDType
    shape: list[NonNegInt] = Field(max_length=4)
    data: bytes

    @model_validator(mode="after")
    def _check_size(self) -> "Tensor":
        expected = math.prod(self.shape) * _ITEMSIZE[self.dtype]
        if len(self.data) != expected:
            raise ValueError(
                f"tensor data is {len(self.data)} bytes, shape {self.shape} of {self.dtype} needs {expected}"
            )
        return self

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> "Tensor":
        """Wrap an int32/uint32/uint8/float32/float16 array (one copy into `bytes`)."""
        arr = np.asarray(arr)
        for name, dt in _NUMPY_DTYPES.items():
            if arr.dtype.kind == dt.kind and arr.dtype.itemsize == dt.itemsize:
                contiguous = np.ascontiguousarray(arr, dtype=dt)
                return cls(dtype=name, shape=list(contiguous.shape), data=contiguous.tobytes())
        raise TypeError(f"unsupported numpy dtype {arr.dtype}; convert to int32/uint32/uint8/float32/float16")

    def to_numpy(self) -> np.ndarray:
        """Zero-copy, read-only view of `data`. bfloat16 raises: numpy has no such dtype."""
        if self.dtype not in _NUMPY_DTYPES:
            raise TypeError(f"{self.dtype} has no numpy dtype; use .data and .shape directly")
        return np.frombuffer(self.data, dtype=_NUMPY_DTYPES[self.dtype]).reshape(self.shape)


class Hello(_Strict):
    actor_id: ActorId
    host: Annotated[str, printable(256)]
    backend: Label
    versions: dict[Label, Annotated[str, printable(128)]] = Field(max_length=32)
    capacity: PositiveFloat = 1.0  # tokens/s hint for scheduling
    metrics_port: Port = 0  # 0 = no /metrics; else listed in the learner's service discovery
    # Leases this actor still means to deliver (after a reconnect); the learner
    # re-queues its other ones at once instead of waiting for them to expire.
    holding: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(default_factory=list, max_length=8)


class GenerationParams(_Strict):
    group_size: int = Field(ge=2, le=1024)
    max_tokens: int = Field(ge=1, le=32768)
    temperature: PositiveFloat
    top_p: float = Field(gt=0, le=1, allow_inf_nan=False)


RewardName = Annotated[str, Field(min_length=1, max_length=64)]


class RewardSpec(_Strict):
    # Empty only in an episode run (Welcome.env), where the episode's own reward stands alone.
    names: list[RewardName] = Field(max_length=16)
    weights: list[FiniteFloat] = Field(max_length=16)
    # task.reward_module as the learner reaches it (an absolute file path or a module
    # name) and the BLAKE3 of its source: an actor runs only a copy with that digest.
    module: Optional[Annotated[str, printable(1024)]] = None
    module_digest: Optional[Blake3Hex] = None
    timeout_seconds: PositiveSeconds = 10.0
    bound: PositiveFloat = 1e4  # task.reward_bound: the learner refuses rewards beyond it

    @model_validator(mode="after")
    def _same_length(self) -> "RewardSpec":
        if len(self.names) != len(self.weights):
            raise ValueError(f"{len(self.names)} reward names but {len(self.weights)} weights")
        if (self.module is None) != (self.module_digest is None):
            raise ValueError("a reward module needs its digest, and a digest its module")
        return self


class ModelRef(_Strict):
    path: str = Field(min_length=1, max_length=1024)
    digest: Blake3Hex
    # LoRA settings that rebuild the same trainable structure; None = full weights.
    lora: Optional[dict[str, LoraValue]] = Field(default=None, max_length=64)
    dtype: Optional[str] = None
    chat_template: bool = False
    system_prompt: Optional[str] = None


# Episodes (task.env): bounds on what one episode may hold.
MAX_TURNS = 1024
MAX_EPISODE_TOKENS = 2**20
EpisodeEnd = Literal["done", "max_turns", "budget"]  # the env said done; task.max_turns; task.max_episode_tokens
MessageKey = Annotated[str, Field(min_length=1, max_length=64)]
ChatMessage = dict[MessageKey, JsonValue]  # {"role": ..., "content": ...}, as chat templates take them


class EnvSpec(_Strict):
    """task.env as Welcome names it: the environment class actors run episodes in, from their own checked copy."""

    module: Annotated[str, printable(1024)]  # a file path (absolute, as the learner reaches it) or a module name
    class_name: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
    module_digest: Blake3Hex
    config: dict[Annotated[str, Field(min_length=1, max_length=256)], JsonValue] = Field(default_factory=dict,
                                                                                          max_length=256)
    max_turns: int = Field(ge=1, le=MAX_TURNS)
    max_episode_tokens: int = Field(ge=1, le=MAX_EPISODE_TOKENS)  # sampled and environment tokens after the prompt
    timeout_seconds: PositiveSeconds = 10.0  # one init/step/close call


class Welcome(_Strict):
    run_id: RunId
    actor_id: ActorId
    model: ModelRef
    generation: GenerationParams
    reward: RewardSpec
    policy_version: Version
    heartbeat_seconds: PositiveSeconds
    pub_address: Optional[Annotated[str, printable(1024)]] = None
    vocab_size: int = Field(ge=1, le=INT32_MAX)
    incarnation: Incarnation = ""  # this life of the learner; a new one means "reload policy_version"
    env: Optional[EnvSpec] = None  # set: every prompt is an episode (envs/), else one completion per sample
    # grpo.max_staleness: groups sampled more versions behind than this are refused. An actor starts new work at
    # its loaded version only while that leaves two more steps within it (actor/rolling.py may_refill).
    max_staleness: Optional[NonNegInt] = None

    @model_validator(mode="after")
    def _scored(self) -> "Welcome":
        if not self.reward.names and self.env is None:
            raise ValueError("a run without an environment needs at least one reward")
        return self


class GetWeights(_Strict):
    """Ask for `length` bytes at `offset` of a version's weight blob (length 0 = the learner's chunk size)."""

    version: Version
    offset: ByteCount = 0
    length: ByteCount = 0


class WeightsGone(_Strict):
    """The answer to a GetWeights for a version the learner no longer keeps, or will not send this peer now (its
    earlier chunks are still queued: learner/door/weights_in_flight.py): fetch `current` instead."""

    requested: Version
    current: Version


class WeightsChunk(_Strict):
    """Header of one slice of a weight blob; the bytes travel raw in the next frame.

    Keeping the bytes out of msgpack lets the learner send every actor the same
    serialized blob with zero-copy sends, in chunks, under the actor's credit window.
    """

    version: Version
    digest: Blake3Hex  # BLAKE3-256 of the whole blob
    total_bytes: ByteCount
    offset: ByteCount
    length: ByteCount
    format: Literal["safetensors"] = "safetensors"


class LeaseRequest(_Strict):
    max_groups: int = Field(ge=1, le=256)


class PromptItem(_Strict):
    group_id: GroupId
    prompt_index: NonNegInt
    prompt_tokens: Tensor
    # The rewards' keyword arguments: every dataset column, and `answer`. Nested
    # values are bounded by the decoder's depth and the message size limits.
    fields: dict[Annotated[str, Field(min_length=1, max_length=256)], JsonValue] = Field(max_length=256)
    prompt_text: str = ""  # the prompt rewards see (a conversation's last user message)
    # The conversation prompt_tokens render (system prompt included): what an episode's env.init gets.
    # None: [{"role": "user", "content": prompt_text}], after Welcome's system prompt if any.
    messages: Optional[list[ChatMessage]] = Field(default=None, max_length=256)


class EvalSampling(_Strict):
    """How an eval lease is sampled: `samples` completions per prompt at `temperature` (0 = greedy)."""

    samples: int = Field(ge=1, le=1024)
    temperature: NonNegFloat


class Lease(_Strict):
    lease_id: LeaseId
    deadline_seconds: Seconds  # relative: actor and learner clocks need not agree
    policy_version: Version
    prompts: list[PromptItem] = Field(max_length=256)  # empty = nothing to do now
    retry_after: Seconds = 0.5
    # Set on eval leases (held-out prompts; learner/evals/evaluation.py): sample this way, score, return as usual.
    eval: Optional[EvalSampling] = None


class Completion(_Strict):
    tokens: Tensor
    logprobs: Tensor
    reward: FiniteFloat
    finish_reason: Literal["stop", "length"]
    # An episode's (Welcome.env), all three or none: `mask` is 1 at each token the model sampled and 0 at each
    # the environment gave (observations through the chat template), whose logprob must be exactly 0; `turns`
    # the offsets where the sampled turns start; `end` why the episode ended. None / "": every token was sampled.
    mask: Optional[Tensor] = None
    turns: Optional[list[NonNegInt]] = Field(default=None, max_length=MAX_TURNS)
    end: Literal["", "done", "max_turns", "budget"] = ""

    @model_validator(mode="after")
    def _intrinsic(self) -> "Completion":
        if self.tokens.dtype not in ("int32", "uint32") or len(self.tokens.shape) != 1:
            raise ValueError("tokens must be a 1-D int32/uint32 tensor")
        if self.logprobs.dtype != "float32" or len(self.logprobs.shape) != 1:
            raise ValueError("logprobs must be a 1-D float32 tensor")
        if self.tokens.shape[0] != self.logprobs.shape[0]:
            raise ValueError(f"{self.tokens.shape[0]} tokens but {self.logprobs.shape[0]} logprobs")
        if self.tokens.shape[0] < 1:
            raise ValueError("a completion needs at least one token")
        if not math.isfinite(self.reward):
            raise ValueError("reward must be finite")
        problem = episode_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def episode_problem(completion: "Completion") -> Optional[str]:
    """What is wrong with a completion's episode fields (mask, turns, end), or None when they hold together.

    Sampled turns are the runs of 1s in the mask and nothing else: `turns` lists
    exactly where each run starts, and an episode ends on a sampled token (an
    observation nobody answered is never sent). Environment tokens carry no
    logprob, so a nonzero one there is refused rather than ignored.
    """
    if completion.mask is None and completion.turns is None and not completion.end:
        return None
    if completion.mask is None or completion.turns is None or not completion.end:
        return "an episode needs mask, turns and end together"
    if completion.mask.dtype != "uint8" or completion.mask.shape != completion.tokens.shape:
        return f"mask must be a uint8 tensor of the tokens' shape {completion.tokens.shape}"
    mask = completion.mask.to_numpy()
    if mask.size == 0 or int(mask.max()) > 1 or int(mask[-1]) != 1:
        return "mask values must be 0 or 1, ending on a sampled token (1)"
    starts = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=np.int8(0)) == 1)
    if completion.turns != starts.tolist():
        return f"turns {completion.turns[:8]} are not where the mask's sampled runs start {starts[:8].tolist()}"
    if np.any(completion.logprobs.to_numpy()[mask == 0] != 0.0):
        return "environment tokens (mask 0) must carry logprob 0: only sampled tokens have one"
    return None


class GroupResult(_Strict):
    group_id: GroupId
    completions: list[Completion] = Field(min_length=1, max_length=1024)


class UnscoredGroup(_Strict):
    """A leased group the actor generated but could not score (a reward failed: tasks/scoring.py); re-queued."""

    group_id: GroupId
    reward: Annotated[str, printable(64)]
    error: Label
    detail: Reason = ""


class Rollouts(_Strict):
    lease_id: LeaseId
    policy_version: Version
    # The learner life whose snapshot sampled these ("" = unknown: trusted only for shared history).
    incarnation: Incarnation = ""
    groups: list[GroupResult] = Field(max_length=256)
    unscored: list[UnscoredGroup] = Field(default_factory=list, max_length=256)

    @model_validator(mode="after")
    def _something(self) -> "Rollouts":
        if not self.groups and not self.unscored:
            raise ValueError("a submission needs at least one group, scored or unscored")
        if len(self.groups) + len(self.unscored) > 256:
            raise ValueError("at most 256 groups in one submission")
        return self


class Ack(_Strict):
    lease_id: LeaseId  # the submission this answers
    status: Literal["accepted", "duplicate", "stale", "invalid", "requeued"]  # requeued: only unscored groups
    reason: Reason = ""
    groups: dict[GroupId, Label] = Field(default_factory=dict)  # group_id -> status


class Heartbeat(_Strict):
    actor_id: OptionalActorId = ""
    policy_version: Version = 0
    sent_at: Timestamp = 0.0  # informational only; clocks are not assumed in sync
    incarnation: Incarnation = ""  # set by the learner; actors leave it empty


# ErrorReply.reason for a Rollouts the learner has no room to verify now: resend it shortly (not an error).
BUSY = "busy"


class ErrorReply(_Strict):
    reason: Label  # short machine label, e.g. "malformed"
    detail: Reason = ""


class StatusRequest(_Strict):
    """Ask the learner for a summary of the run (`grpo-fleet status`); allowed without Hello."""


class ActorStatus(_Strict):
    actor_id: ActorId
    host: Annotated[str, printable(256)]
    backend: Label
    policy_version: Version
    tokens_per_second: NonNegFloat
    last_seen_seconds: Seconds
    # Measured from returned leases; what the learner sizes this actor's leases by.
    groups_per_second: Optional[NonNegFloat] = None


class Status(_Strict):
    run_id: RunId
    step: Count
    steps_target: Count
    policy_version: Version
    tokens_per_second: NonNegFloat
    groups_accepted: Count
    actors: list[ActorStatus] = Field(max_length=4096)


class PolicyUpdated(_Strict):
    version: Version
    digest: str
    incarnation: Incarnation = ""


class Shutdown(_Strict):
    reason: Reason = ""


Message = Union[
    Hello, Welcome, GetWeights, WeightsChunk, WeightsGone, LeaseRequest, Lease,
    Rollouts, Ack, Heartbeat, ErrorReply, PolicyUpdated, Shutdown, StatusRequest, Status,
]

# Only top-level messages travel in an envelope; component models (Tensor, ...) do not.
# Derived from `Message`, so a new message type cannot be in one list and missing from the other.
MESSAGE_TYPES: dict[str, type[BaseModel]] = {cls.__name__: cls for cls in get_args(Message)}


def validate_rollouts(
    msg: Rollouts, *, group_size: int, vocab_size: int, max_tokens: int, reward_bound: float = 1e4,
    stop_token_ids: Optional[frozenset[int]] = None, episode_tokens: Optional[int] = None,
) -> Optional[RejectReason]:
    """Run-dependent checks; returns why the batch is unusable, or None when it is usable.

    Values are checked in the dtype they are trained in: a reward of 1e39 is a
    finite float64 but inf in float32, so rewards must lie within `reward_bound`.
    With `stop_token_ids` (the tokens that end sampling), each `finish_reason` is
    checked against its tokens (`finish_reason_mismatch`; an episode's turn by
    turn, `episode_finish_mismatch`). `episode_tokens` is task.max_episode_tokens
    in a run with an environment: every completion must then be an episode no
    longer than that (and `max_tokens` bounds each turn); None: none may be one.
    """
    ids = [g.group_id for g in msg.groups] + [u.group_id for u in msg.unscored]
    if len(set(ids)) != len(ids):
        return RejectReason.DUPLICATE_GROUP_IN_MESSAGE
    if not ids:  # model_construct() bypasses the validator that refuses an empty submission
        return RejectReason.BAD_GROUP_SIZE
    completions = [c for g in msg.groups for c in g.completions]
    if any(len(g.completions) != group_size for g in msg.groups):
        return RejectReason.BAD_GROUP_SIZE
    if not completions:
        return None
    # Re-checked here because model_construct() bypasses the Completion validator.
    if any(c.tokens.shape != c.logprobs.shape or len(c.tokens.shape) != 1 for c in completions):
        return RejectReason.LENGTH_MISMATCH
    if any((c.mask is not None) != (episode_tokens is not None) for c in completions):
        return RejectReason.EPISODE_MISMATCH
    if any(c.tokens.shape[0] > (max_tokens if episode_tokens is None else episode_tokens) for c in completions):
        return RejectReason.TOO_LONG
    if any(c.mask is not None and longest_turn(c.mask.to_numpy()) > max_tokens for c in completions):
        return RejectReason.TOO_LONG  # sampling ends a turn at max_tokens: a longer one was not sampled so
    # One concatenation per kind keeps the checks vectorised over the whole message.
    tokens = np.concatenate([c.tokens.to_numpy().astype(np.int64, copy=False) for c in completions])
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        return RejectReason.TOKEN_OUT_OF_RANGE
    logprobs = np.concatenate([c.logprobs.to_numpy() for c in completions])
    rewards = np.array([c.reward for c in completions], dtype=np.float64)
    # Values that cannot be trained on are named first: they are what a poisoned message is about.
    out_of_bounds = values_out_of_bounds(logprobs, rewards, reward_bound)
    if out_of_bounds is not None:
        return out_of_bounds
    if stop_token_ids is not None and any(_finish_mismatch(c, stop_token_ids, max_tokens, episode_tokens)
                                          for c in completions):
        return RejectReason.FINISH_REASON_MISMATCH
    return None


def finish_reason_mismatch(tokens: np.ndarray, finish_reason: str, stop_token_ids: frozenset[int], max_tokens: int) -> bool:
    """True when `finish_reason` cannot be what sampling `tokens` ended with.

    Sampling stops at the first stop token ("stop", the token kept) or after
    `max_tokens` ("length"); a stop token wins when both hold. So no stop token
    comes before the last one, "stop" ends with one, and "length" has exactly
    `max_tokens` and does not. A cut-off completion claimed finished would escape
    grpo.mask_truncated and the overlong penalty.
    """
    ids = tokens.astype(np.int64, copy=False)
    stops = _is_stop(ids, stop_token_ids)
    if stops[:-1].any():
        return True
    if finish_reason == "stop":
        return not bool(stops[-1])
    return bool(stops[-1]) or len(ids) != max_tokens


def _is_stop(ids: np.ndarray, stop_token_ids: frozenset[int]) -> np.ndarray:
    """Where `ids` holds a stop token. A comparison per stop id: models have a handful, and np.isin's setup
    cost was 9% of a tiny model's learner (every completion of every submission passes here)."""
    stops = np.zeros(ids.shape, dtype=bool)
    for stop in stop_token_ids:
        stops |= ids == stop
    return stops


def _finish_mismatch(completion: Completion, stop_token_ids: frozenset[int], max_tokens: int,
                     episode_tokens: Optional[int]) -> bool:
    tokens = completion.tokens.to_numpy()
    if completion.mask is None:
        return finish_reason_mismatch(tokens, completion.finish_reason, stop_token_ids, max_tokens)
    return episode_finish_mismatch(tokens, completion.mask.to_numpy(), completion.finish_reason, stop_token_ids,
                                   max_tokens, episode_tokens or MAX_EPISODE_TOKENS)


def episode_finish_mismatch(tokens: np.ndarray, mask: np.ndarray, finish_reason: str, stop_token_ids: frozenset[int],
                            max_tokens: int, episode_tokens: int) -> bool:
    """True when an episode's sampled turns cannot have ended as sampling ends them.

    Each turn (a run of 1s in the mask) is sampled like a single completion: it
    holds no stop token before its last, and ends with one or after `max_tokens`.
    The last turn's `finish_reason` is the episode's; a "length" there may also
    be the episode's own budget running out, which leaves exactly
    `episode_tokens` tokens in all (the runner gives a turn no more room).
    """
    ids = tokens.astype(np.int64, copy=False)
    stops = _is_stop(ids, stop_token_ids)
    starts, stops_at = turn_spans(mask)
    turns = list(zip(starts.tolist(), stops_at.tolist()))
    for index, (start, stop) in enumerate(turns):
        if stops[start : stop - 1].any():
            return True
        ends_on_stop, full = bool(stops[stop - 1]), stop - start == max_tokens
        if index < len(turns) - 1:
            if not (ends_on_stop or full):
                return True
        elif finish_reason == "stop":
            return not ends_on_stop
        else:
            return ends_on_stop or not (full or len(ids) == episode_tokens)
    return False


def turn_spans(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where an episode's sampled turns (the runs of 1s in its mask) start, and where each stops (exclusive)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return edges[::2], edges[1::2]


def longest_turn(mask: np.ndarray) -> int:
    """The most tokens in one sampled turn."""
    starts, stops = turn_spans(mask)
    return int((stops - starts).max(initial=0))


def values_out_of_bounds(logprobs: np.ndarray, rewards: np.ndarray, reward_bound: float) -> Optional[RejectReason]:
    """BAD_LOGPROB or BAD_REWARD when a value cannot be trained on in float32, else None."""
    if not np.all((logprobs >= LOGPROB_FLOOR) & (logprobs <= LOGPROB_CEILING)):  # NaN fails both
        return RejectReason.BAD_LOGPROB
    if not np.all(np.abs(rewards) <= reward_bound):
        return RejectReason.BAD_REWARD
    return None
