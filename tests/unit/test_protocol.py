"""Wire protocol: message models, the hardened codec, and framed zmq sockets."""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from grpo_fleet.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    ActorStatus,
    Completion,
    ErrorReply,
    EvalSampling,
    GenerationParams,
    GetWeights,
    GroupResult,
    Heartbeat,
    Hello,
    Lease,
    LeaseRequest,
    Limits,
    ModelRef,
    PolicyUpdated,
    PromptItem,
    ProtocolError,
    RewardSpec,
    Rollouts,
    Shutdown,
    Status,
    StatusRequest,
    Tensor,
    UnscoredGroup,
    WeightsChunk,
    WeightsGone,
    Welcome,
    blob_digest,
    decode,
    encode,
    validate_rollouts,
)
from grpo_fleet.protocol.messages import EnvSpec
from grpo_fleet.protocol.reasons import RejectReason
from wire_samples import bulky

DIGEST = hashlib.sha256(b"weights").hexdigest()
VOCAB = 100
G = 2
MAX_TOKENS = 8


# ---------------------------------------------------------------- builders


def completion(tokens: list[int], logprobs: list[float] | None = None, reward: float = 1.0) -> Completion:
    lp = [-0.5] * len(tokens) if logprobs is None else logprobs
    return Completion(
        tokens=Tensor.from_numpy(np.array(tokens, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.array(lp, dtype=np.float32)),
        reward=reward,
        finish_reason="stop",
    )


def rollouts(*groups: GroupResult) -> Rollouts:
    return Rollouts(lease_id="L1", policy_version=3, groups=list(groups))


def group(gid: str, *comps: Completion) -> GroupResult:
    return GroupResult(group_id=gid, completions=list(comps))


def valid_rollouts() -> Rollouts:
    return rollouts(
        group("g0", completion([1, 2, 3]), completion([4], reward=0.0)),
        group("g1", completion([VOCAB - 1] * MAX_TOKENS), completion([0, 5], [0.0, 1e-5])),
    )


def sample_messages() -> list[BaseModel]:
    prompt = PromptItem(
        group_id="g0", prompt_index=7, prompt_tokens=Tensor.from_numpy(np.arange(5, dtype=np.int32)),
        fields={"answer": "42", "level": 3, "tags": ["a", {"b": None}], "weight": 0.5}, prompt_text="What is 6*7?",
    )
    model = ModelRef(
        path="/models/tiny", digest=DIGEST,
        lora={"rank": 8, "scale": 20.0, "keys": ["q_proj", "v_proj"], "dropout": None, "use_dora": False},
        dtype="bfloat16", chat_template=True, system_prompt="Be brief.",
    )
    return [
        Hello(actor_id="a1", host="h", backend="mlx", versions={"mlx": "0.29"}, capacity=250.0),
        Welcome(
            run_id="r", actor_id="a1", model=model,
            generation=GenerationParams(group_size=4, max_tokens=64, temperature=1.0, top_p=0.95),
            reward=RewardSpec(names=["correct", "format"], weights=[1.0, 0.1], module="/home/me/my_rewards.py",
                              module_digest=DIGEST, timeout_seconds=5.0, bound=100.0),
            policy_version=0, heartbeat_seconds=2.0, pub_address="tcp://127.0.0.1:5556", vocab_size=320,
        ),
        GetWeights(version=3),
        WeightsChunk(version=3, digest=DIGEST, total_bytes=100, offset=0, length=20),
        WeightsGone(requested=1, current=3),
        StatusRequest(),
        Status(run_id="r", step=3, steps_target=10, policy_version=3, tokens_per_second=12.5, groups_accepted=7,
               actors=[ActorStatus(actor_id="a1", host="h", backend="cpu", policy_version=2,
                                   tokens_per_second=6.0, last_seen_seconds=0.4)]),
        LeaseRequest(max_groups=4),
        Lease(lease_id="L1", deadline_seconds=60.0, policy_version=3, prompts=[prompt]),
        Lease(lease_id="L2", deadline_seconds=0.0, policy_version=3, prompts=[], retry_after=1.5),
        Lease(lease_id="L3", deadline_seconds=60.0, policy_version=3, prompts=[prompt],
              eval=EvalSampling(samples=4, temperature=0.7)),
        valid_rollouts(),
        Rollouts(lease_id="L1", policy_version=3, groups=[],
                 unscored=[UnscoredGroup(group_id="g1", reward="correct", error="timeout", detail="ran past 5s")]),
        Ack(lease_id="L1", status="accepted", groups={"g0": "accepted", "g1": "duplicate"}),
        Heartbeat(actor_id="a1", policy_version=2, sent_at=1.5),
        ErrorReply(reason="malformed", detail="truncated"),
        PolicyUpdated(version=4, digest=DIGEST),
        Shutdown(reason="done"),
        *episode_messages(prompt, model),
    ]


def episode_messages(prompt: PromptItem, model: ModelRef) -> list[BaseModel]:
    """An episode run (issue 28): Welcome names the environment, prompts carry their conversation, completions
    carry their sampled/environment mask, turn starts and end."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"}]
    episode = Completion(
        tokens=Tensor.from_numpy(np.array([5, 6, 2, 9, 9, 7, 2], dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.array([-0.5, -0.1, -0.2, 0.0, 0.0, -0.3, -0.1], dtype=np.float32)),
        reward=0.5, finish_reason="stop", mask=Tensor.from_numpy(np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)),
        turns=[0, 5], end="done",
    )
    return [
        Welcome(
            run_id="r", actor_id="a1", model=model,
            generation=GenerationParams(group_size=2, max_tokens=16, temperature=1.0, top_p=1.0),
            reward=RewardSpec(names=[], weights=[]), policy_version=0, heartbeat_seconds=2.0, vocab_size=320,
            env=EnvSpec(module="/home/me/my_env.py", class_name="Guess", module_digest=DIGEST, config={"tries": 2},
                        max_turns=3, max_episode_tokens=256, timeout_seconds=5.0),
        ),
        Lease(lease_id="L4", deadline_seconds=60.0, policy_version=3,
              prompts=[prompt.model_copy(update={"messages": conversation})]),
        rollouts(group("g2", episode, episode)),
    ]


def envelope(type_: object = "GetWeights", body: object = None, v: object = PROTOCOL_VERSION) -> bytes:
    body = {"version": 1} if body is None else body
    return msgpack.packb({"v": v, "type": type_, "body": body}, use_bin_type=True)


def reason_of(data: bytes, limits: Limits | None = None) -> str:
    with pytest.raises(ProtocolError) as info:
        decode(data, limits) if limits else decode(data)
    return info.value.reason


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("msg", sample_messages(), ids=lambda m: type(m).__name__)
def test_round_trip_every_message_type(msg: BaseModel) -> None:
    data = encode(msg)
    assert decode(data) == msg
    assert msgpack.unpackb(data)["type"] == type(msg).__name__


def test_samples_cover_every_message_type() -> None:
    assert {type(m).__name__ for m in sample_messages()} == set(MESSAGE_TYPES)


def test_bytes_travel_as_raw_bin() -> None:
    payload = bytes(range(256)) * 64
    data = encode(bulky(len(payload)))
    assert payload in data  # no base64: the raw bytes appear verbatim
    assert len(data) < len(payload) + 256  # framing only (base64 would add a third)


def test_encode_rejects_component_models() -> None:
    with pytest.raises(TypeError):
        encode(Tensor.from_numpy(np.zeros(2, dtype=np.int32)))


def test_tensor_numpy_round_trip_is_zero_copy_view() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = Tensor.from_numpy(arr)
    back = t.to_numpy()
    assert back.dtype == np.float32 and back.shape == (3, 4)
    np.testing.assert_array_equal(back, arr)
    assert not back.flags.writeable  # a view on the immutable bytes, not a copy
    assert Tensor.from_numpy(np.zeros((0, 3), dtype=np.float16)).to_numpy().shape == (0, 3)


def test_tensor_from_numpy_normalises_byte_order() -> None:
    arr = np.arange(4, dtype=">i4")
    np.testing.assert_array_equal(Tensor.from_numpy(arr).to_numpy(), [0, 1, 2, 3])


def test_tensor_bfloat16_raw_only() -> None:
    t = Tensor(dtype="bfloat16", shape=[2, 2], data=b"\x00" * 8)
    with pytest.raises(TypeError):
        t.to_numpy()
    with pytest.raises(TypeError):
        Tensor.from_numpy(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize(
    "fields",
    [
        {"dtype": "int64", "shape": [1], "data": b"\x00" * 8},
        {"dtype": "int32", "shape": [2], "data": b"\x00" * 4},
        {"dtype": "float16", "shape": [3], "data": b"\x00" * 4},
        {"dtype": "int32", "shape": [-1], "data": b""},
        {"dtype": "int32", "shape": [1, 1, 1, 1, 1], "data": b"\x00" * 4},
        {"dtype": "int32", "shape": [1], "data": "abcd"},
        {"dtype": "int32", "shape": [1.0], "data": b"\x00" * 4},
    ],
)
def test_tensor_validation_rejects(fields: dict) -> None:
    with pytest.raises(ValidationError):
        Tensor.model_validate(fields, strict=True)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Completion(tokens=Tensor.from_numpy(np.zeros(2, np.float32)),
                           logprobs=Tensor.from_numpy(np.zeros(2, np.float32)), reward=0.0, finish_reason="stop"),
        lambda: Completion(tokens=Tensor.from_numpy(np.zeros((1, 2), np.int32)),
                           logprobs=Tensor.from_numpy(np.zeros((1, 2), np.float32)), reward=0.0, finish_reason="stop"),
        lambda: completion([1, 2], [-1.0]),
        lambda: completion([], []),
        lambda: completion([1], reward=math.nan),
        lambda: completion([1], reward=math.inf),
    ],
    ids=["float_tokens", "2d", "length", "empty", "nan_reward", "inf_reward"],
)
def test_completion_intrinsic_checks(build: Callable[[], Completion]) -> None:
    with pytest.raises(ValidationError):
        build()


def test_completion_accepts_uint32_tokens() -> None:
    c = Completion(tokens=Tensor.from_numpy(np.array([1, 2], np.uint32)),
                   logprobs=Tensor.from_numpy(np.array([-1, -2], np.float32)), reward=1, finish_reason="length")
    assert c.reward == 1.0


def test_models_are_frozen_and_closed() -> None:
    msg = GetWeights(version=1)
    with pytest.raises(ValidationError):
        msg.version = 2  # type: ignore[misc]
    with pytest.raises(ValidationError):
        GetWeights(version=1, extra=True)  # type: ignore[call-arg]


def test_blob_digest_is_blake3_hex() -> None:
    import blake3

    assert blob_digest(b"abc") == blake3.blake3(b"abc").hexdigest()
    assert len(blob_digest(b"abc")) == 64 and blob_digest(b"abc") != blob_digest(b"abd")


def test_reward_spec_lengths_must_match() -> None:
    with pytest.raises(ValidationError):
        RewardSpec(names=["a", "b"], weights=[1.0])


# ---------------------------------------------------------------- validate_rollouts


def test_validate_rollouts_accepts_valid_batch() -> None:
    assert validate_rollouts(valid_rollouts(), group_size=G, vocab_size=VOCAB, max_tokens=MAX_TOKENS) is None


def _length_mismatch() -> Rollouts:
    bad = Completion.model_construct(
        tokens=Tensor.from_numpy(np.array([1, 2], np.int32)),
        logprobs=Tensor.from_numpy(np.array([-1.0], np.float32)), reward=0.0, finish_reason="stop",
    )
    # Validation would refuse this, so the whole chain is built with model_construct.
    grp = GroupResult.model_construct(group_id="g0", completions=[completion([1]), bad])
    return Rollouts.model_construct(lease_id="L1", policy_version=0, groups=[grp])


@pytest.mark.parametrize(
    "build, reason",
    [
        (lambda: rollouts(group("g0", completion([1]), completion([2]), completion([3]))), RejectReason.BAD_GROUP_SIZE),
        (lambda: rollouts(group("g0", completion([1]))), RejectReason.BAD_GROUP_SIZE),
        (lambda: rollouts(group("g0", completion([1]), completion([VOCAB]))), RejectReason.TOKEN_OUT_OF_RANGE),
        (lambda: rollouts(group("g0", completion([1]), completion([-1]))), RejectReason.TOKEN_OUT_OF_RANGE),
        (_length_mismatch, RejectReason.LENGTH_MISMATCH),
        (lambda: rollouts(group("g0", completion([1]), completion([1], [0.5]))), RejectReason.BAD_LOGPROB),
        (lambda: rollouts(group("g0", completion([1]), completion([1], [math.nan]))), RejectReason.BAD_LOGPROB),
        (lambda: rollouts(group("g0", completion([1]), completion([1], [-math.inf]))), RejectReason.BAD_LOGPROB),
        (lambda: rollouts(group("g0", completion([1]), completion([1] * (MAX_TOKENS + 1)))), RejectReason.TOO_LONG),
        (lambda: rollouts(group("g0", completion([1]), completion([2])),
                          group("g0", completion([1]), completion([2]))), RejectReason.DUPLICATE_GROUP_IN_MESSAGE),
    ],
)
def test_validate_rollouts_reasons(build: Callable[[], Rollouts], reason: RejectReason) -> None:
    assert validate_rollouts(build(), group_size=G, vocab_size=VOCAB, max_tokens=MAX_TOKENS) is reason


def test_validate_rollouts_uint32_above_vocab() -> None:
    big = Completion(tokens=Tensor.from_numpy(np.array([2**32 - 1], np.uint32)),
                     logprobs=Tensor.from_numpy(np.array([-1], np.float32)), reward=0.0, finish_reason="stop")
    msg = rollouts(group("g0", completion([1]), big))
    assert validate_rollouts(msg, group_size=G, vocab_size=VOCAB, max_tokens=MAX_TOKENS) == RejectReason.TOKEN_OUT_OF_RANGE


# ---------------------------------------------------------------- decode rejects


def test_decode_rejects_oversize_before_parsing() -> None:
    data = encode(bulky(1000))
    assert reason_of(data, Limits(max_message_bytes=500)) == "too_large"


def test_decode_rejects_bin_over_limit() -> None:
    data = encode(bulky(1000))
    assert reason_of(data, Limits(max_bin_len=100)) == "too_large"


def test_decode_rejects_long_array() -> None:
    data = envelope("Ack", {"status": "accepted", "reason": "", "groups": {}, "pad": list(range(50))})
    assert reason_of(data, Limits(max_array_len=10)) == "too_large"


def test_decode_rejects_truncated() -> None:
    data = encode(valid_rollouts())
    for cut in (1, 7, len(data) // 2, len(data) - 1):
        assert reason_of(data[:cut]) == "malformed"
    assert reason_of(b"") == "malformed"


def test_decode_rejects_trailing_bytes() -> None:
    assert reason_of(encode(GetWeights(version=1)) + b"\x00") == "malformed"


@pytest.mark.parametrize(
    "data",
    [
        envelope("Ack", {"status": msgpack.ExtType(5, b"abcd")}),
        envelope("Ack", {"status": msgpack.Timestamp(1)}),
        b"\xc7\x00\x05",  # zero-length ext8, which slips under max_ext_len=0
    ],
    ids=["ext", "timestamp", "empty_ext"],
)
def test_decode_rejects_ext_types(data: bytes) -> None:
    assert reason_of(data) == "malformed"


@pytest.mark.parametrize(
    "obj",
    [
        {1: 2},
        {"v": 1, "type": "GetWeights", "body": {"version": 1, 3: 4}},
        {b"v": 1, b"type": "GetWeights", b"body": {"version": 1}},
        {"v": 1, "type": "GetWeights", "body": {b"version": 1}},
    ],
    ids=["int_key", "nested_int_key", "bytes_keys", "nested_bytes_key"],
)
def test_decode_rejects_non_string_keys(obj: object) -> None:
    assert reason_of(msgpack.packb(obj, use_bin_type=True)) == "malformed"


def test_decode_rejects_deep_nesting() -> None:
    nested: object = 1
    for _ in range(20):
        nested = [nested]
    assert reason_of(envelope("Ack", {"status": "accepted", "reason": nested})) == "too_deep"
    # Deeper than msgpack's own stack: must not become a RecursionError or a crash.
    assert reason_of(b"\x91" * 100_000 + b"\x00") == "too_deep"


def test_decode_accepts_depth_at_limit() -> None:
    assert decode(encode(valid_rollouts()), Limits(max_depth=8)) == valid_rollouts()


@pytest.mark.parametrize("v", [1, 2, 3, 5, 0, "4", 4.0, True, None])
def test_decode_rejects_wrong_version(v: object) -> None:
    assert reason_of(envelope(v=v)) == "bad_version"


def test_a_v1_peer_is_told_which_protocol_versions_differ() -> None:
    assert PROTOCOL_VERSION == 4
    with pytest.raises(ProtocolError, match="protocol version 1, but this grpo-fleet speaks 4"):
        decode(envelope(v=1))


def test_an_actor_from_before_episodes_is_told_to_upgrade() -> None:
    # Version 3 actors know no episode fields: their Hello is refused at the door, with a reason that says why.
    hello = {"actor_id": "old-mac", "host": "old", "backend": "cpu", "versions": {}}
    with pytest.raises(ProtocolError, match="protocol version 3, but this grpo-fleet speaks 4: run the same release"):
        decode(envelope(v=3, type_="Hello", body=hello))


@pytest.mark.parametrize("type_", ["Pickle", "Tensor", "", 5, None, b"GetWeights"])
def test_decode_rejects_unknown_type(type_: object) -> None:
    assert reason_of(envelope(type_=type_)) == "unknown_type"


@pytest.mark.parametrize(
    "obj",
    [
        [1, "GetWeights", {"version": 1}],
        "hello",
        {"v": 1, "type": "GetWeights"},
        {"v": 1, "type": "GetWeights", "body": {"version": 1}, "extra": 0},
    ],
    ids=["list", "str", "missing_body", "extra_key"],
)
def test_decode_rejects_bad_envelope(obj: object) -> None:
    assert reason_of(msgpack.packb(obj, use_bin_type=True)) == "malformed"


@pytest.mark.parametrize(
    "type_, body",
    [
        ("GetWeights", {"version": 1, "extra": 1}),
        ("GetWeights", {}),
        ("GetWeights", {"version": "1"}),
        ("GetWeights", {"version": 1.0}),
        ("GetWeights", {"version": True}),
        ("GetWeights", {"version": -1}),
        ("GetWeights", [1]),
        ("WeightsChunk", {"version": 1, "digest": DIGEST, "total_bytes": 1, "offset": 0, "length": "1"}),
        ("WeightsChunk", {"version": 1, "digest": "XYZ", "total_bytes": 1, "offset": 0, "length": 1}),
        ("WeightsChunk", {"version": 1, "digest": DIGEST, "total_bytes": 1, "offset": 0, "length": 1, "format": "pickle"}),
        ("Hello", {"actor_id": "", "host": "h", "backend": "b", "versions": {}}),
        ("Hello", {"actor_id": "a", "host": "h", "backend": "b", "versions": {}, "capacity": 0.0}),
        ("Hello", {"actor_id": "a", "host": "h", "backend": "b", "versions": {"k": 1}}),
        ("LeaseRequest", {"max_groups": 257}),
        ("Ack", {"status": "maybe"}),
        ("Rollouts", {"lease_id": "L", "policy_version": 0, "groups": []}),
    ],
)
def test_decode_rejects_invalid_bodies(type_: str, body: object) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(envelope(type_, body))
    assert info.value.reason == "invalid"
    assert type_ in str(info.value)


def test_decode_accepts_int_for_float() -> None:
    msg = decode(envelope("Heartbeat", {"actor_id": "a", "policy_version": 1, "sent_at": 5}))
    assert msg == Heartbeat(actor_id="a", policy_version=1, sent_at=5.0)


def test_decode_accepts_zero_copy_buffers() -> None:
    data = encode(valid_rollouts())
    assert decode(memoryview(data)) == decode(bytearray(data)) == valid_rollouts()


def test_protocol_error_reason_is_from_fixed_set() -> None:
    with pytest.raises(ValueError):
        ProtocolError("whatever")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_decode_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError as exc:
        assert exc.reason in {"too_large", "malformed", "bad_version", "unknown_type", "invalid", "too_deep"}


_VALID = encode(valid_rollouts())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_decode_mutated_message_only_raises_protocol_error(edits: list[tuple[int, int]]) -> None:
    data = bytearray(_VALID)
    for pos, value in edits:
        data[pos] = value
    try:
        decoded = decode(bytes(data))
    except ProtocolError as exc:
        # A flipped byte breaks the framing, the schema or a value; a length header turned huge is "too_large".
        assert exc.reason in {"too_large", "malformed", "bad_version", "unknown_type", "invalid", "too_deep"}, exc
    else:
        assert type(decoded) in set(MESSAGE_TYPES.values()), "what decodes is one of the protocol's messages"


def test_status_table_shows_each_actors_measured_groups_per_second():
    from grpo_fleet.protocol.client import format_status

    actors = [ActorStatus(actor_id="fast", host="studio", backend="gpu", policy_version=3, tokens_per_second=900.0,
                          last_seen_seconds=0.2, groups_per_second=4.5),
              ActorStatus(actor_id="new", host="air", backend="gpu", policy_version=0, tokens_per_second=0.0,
                          last_seen_seconds=0.1)]
    table = format_status(Status(run_id="r", step=3, steps_target=10, policy_version=3, tokens_per_second=900.0,
                                 groups_accepted=7, actors=actors)).splitlines()
    assert "groups/s" in table[2]
    assert "4.50" in next(line for line in table if line.startswith("fast"))
    assert next(line for line in table if line.startswith("new")).split()[-2] == "-"
