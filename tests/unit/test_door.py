"""What the learner lets in at the door: bounded numbers, safe ids, lease-sized Rollouts, escaped logs."""

from __future__ import annotations

import math
import types
from typing import Annotated, Any, Iterator, Union, get_args, get_origin

import annotated_types as at
import msgpack
import numpy as np
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from test_protocol import sample_messages

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.door.intake_rules import inbound_limits
from grpo_fleet.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Limits, ProtocolError, decode, encode
from grpo_fleet.protocol import messages as m
from grpo_fleet.protocol.logsafe import shown

HOSTILE_NUMBERS = [-1, -(2**63), 2**63 - 1, 2**64 - 1, math.nan, math.inf, -math.inf, 1e39, -3e38]
Path = tuple[Union[str, int], ...]


def envelope(type_: str, body: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": type_, "body": body}, use_bin_type=True)


# ---------------------------------------------------------------- walking the message models


def _bounds(metadata: list) -> tuple[float, float]:
    """(lower, upper) declared in pydantic/annotated-types metadata; +-inf where none is declared."""
    lower, upper = -math.inf, math.inf
    for item in metadata:
        if isinstance(item, FieldInfo):
            inner = _bounds(item.metadata)
            lower, upper = max(lower, inner[0]), min(upper, inner[1])
        elif isinstance(item, (at.Ge, at.Gt)):
            lower = max(lower, item.ge if isinstance(item, at.Ge) else item.gt)
        elif isinstance(item, (at.Le, at.Lt)):
            upper = min(upper, item.le if isinstance(item, at.Le) else item.lt)
    return lower, upper


def _arms(annotation: Any) -> list:
    """The non-None alternatives of a Union/Optional, or the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [arg for arg in get_args(annotation) if arg is not type(None)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _base(annotation: Any) -> Any:
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _numeric_leaves(annotation: Any, metadata: list, where: str) -> Iterator[tuple[str, type, tuple]]:
    """Every int/float reachable in a type, recursing into Annotated, Union, list, dict and models."""
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        yield from _numeric_leaves(base, metadata + extra, where)
        return
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arm in _arms(annotation):
            yield from _numeric_leaves(arm, metadata, where)
    elif origin in (list, dict):
        # Field(max_length=...) on the container bounds its length, not its items.
        yield from _numeric_leaves(get_args(annotation)[-1], [], f"{where}[]")
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, info in annotation.model_fields.items():
            yield from _numeric_leaves(info.annotation, list(info.metadata), f"{annotation.__name__}.{name}")
    elif annotation in (int, float):
        yield where, annotation, _bounds(metadata)


# Path in the body, the name _numeric_leaves gives it, its kind, and the bounds by the type it may
# decode to: in a Union (LoraValue) an int beyond the int arm decodes as a float, bounded as one.
Site = tuple[Path, str, type, dict]


def _sites(model: type[BaseModel], body: dict, path: Path = ()) -> Iterator[Site]:
    """Every numeric value present in a sample body (an absent optional number is probed too)."""
    for name, info in model.model_fields.items():
        where = f"{model.__name__}.{name}"
        yield from _value_sites(info.annotation, list(info.metadata), body.get(name), path + (name,), where)


def _value_sites(annotation: Any, metadata: list, value: Any, path: Path, where: str) -> Iterator[Site]:
    if get_origin(annotation) is Annotated:
        base, *extra = get_args(annotation)
        yield from _value_sites(base, metadata + extra, value, path, where)
        return
    arms = _arms(annotation)
    if len(arms) > 1 or get_origin(annotation) in (Union, types.UnionType):
        # The arm this value travels in (LoraValue's int vs float); None: the first arm.
        fits = [a for a in arms if value is not None and (isinstance(value, get_origin(_base(a)) or _base(a))
                                                          or (_is_model(_base(a)) and isinstance(value, dict)))]
        fits = [a for a in fits if not (type(value) is not bool and _base(a) is bool)]
        if fits or value is None:
            for site in _value_sites((fits or arms)[0], metadata, value, path, where):
                yield site[:3] + ({**_arm_bounds(arms), **site[3]},)
        return
    origin = get_origin(annotation)
    if origin is list and value:
        yield from _value_sites(get_args(annotation)[0], [], value[0], path + (0,), f"{where}[]")
    elif origin is dict and value:
        for key, item in value.items():
            yield from _value_sites(get_args(annotation)[1], [], item, path + (key,), f"{where}[]")
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        yield from _sites(annotation, value, path)
    elif annotation in (int, float):
        yield path, where, annotation, {annotation: _bounds(metadata)}


def _arm_bounds(arms: list) -> dict:
    return {_base(a): _bounds(list(get_args(a)[1:])) for a in arms if _base(a) in (int, float)}


def _replaced(body: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    copy = list(body) if isinstance(body, list) else dict(body)
    copy[path[0]] = _replaced(body[path[0]], path[1:], value)
    return copy


def _at(body: Any, path: Path) -> Any:
    for key in path:
        body = body[key]
    return body


def _probes(kind: type, lower: float, upper: float) -> list:
    """The hostile values (floats sent as floats: strict ints refuse them) plus each side of the field's bounds."""
    edges = [lower - 1, upper + 1]
    if kind is float:
        return HOSTILE_NUMBERS + edges + [math.nextafter(lower, -math.inf), math.nextafter(upper, math.inf)]
    # msgpack carries ints in [-2**63, 2**64 - 1]; the HOSTILE_NUMBERS ends stand in beyond it.
    return HOSTILE_NUMBERS + [int(e) for e in edges if -(2**63) <= e <= 2**64 - 1]


def _samples_with_every_optional() -> list[BaseModel]:
    """The protocol samples, plus the optional numbers they leave out."""
    samples = sample_messages()
    status = next(s for s in samples if isinstance(s, m.Status))
    seen = status.actors[0].model_copy(update={"groups_per_second": 2.5})
    return samples + [status.model_copy(update={"actors": [seen]})]


def _all_sites() -> list[tuple[str, dict, Path, str, type, tuple]]:
    sites = []
    for msg in _samples_with_every_optional():
        body = msg.model_dump()
        sites += [(type(msg).__name__, body, *site) for site in _sites(type(msg), body)]
    return sites


ALL_SITES = _all_sites()


def test_every_int_and_float_field_declares_both_bounds() -> None:
    """A new unbounded number anywhere in a message (or a component model) fails here."""
    leaves = [leaf for cls in MESSAGE_TYPES.values() for leaf in _numeric_leaves(cls, [], cls.__name__)]
    assert len(leaves) > 30
    unbounded = [(where, kind.__name__) for where, kind, (lo, hi) in leaves if not (math.isfinite(lo) and math.isfinite(hi))]
    assert unbounded == []


def test_the_probes_reach_every_declared_number() -> None:
    """Each (field, int/float) the models declare is probed in at least one real message."""
    declared = {(where, kind) for cls in MESSAGE_TYPES.values() for where, kind, _ in _numeric_leaves(cls, [], cls.__name__)}
    probed = {(where, kind) for _, _, _, where, kind, _ in ALL_SITES}
    assert declared - probed == set()


@pytest.mark.parametrize("type_, body, path, where, kind, bounds", ALL_SITES,
                         ids=[f"{t}:{'.'.join(map(str, p))}" for t, _, p, *_ in ALL_SITES])
def test_out_of_range_numbers_are_refused_at_the_door(
    type_: str, body: dict, path: Path, where: str, kind: type, bounds: dict
) -> None:
    for value in _probes(kind, *bounds[kind]):
        try:
            decoded = decode(envelope(type_, _replaced(body, path, value)))
        except ProtocolError as exc:
            assert exc.reason == "invalid", (value, exc)
            continue
        got = _at(decoded.model_dump(), path)
        lower, upper = bounds[type(got)]
        assert math.isfinite(got) and lower <= got <= upper, (value, got)


@pytest.mark.parametrize("value", [-1, 2**31, 2**63 - 1])
def test_a_hostile_heartbeat_version_is_refused(value: int) -> None:
    """Issue F.3: this Heartbeat used to decode, then broke every Status reply."""
    with pytest.raises(ProtocolError):
        decode(envelope("Heartbeat", {"actor_id": "a", "policy_version": value, "sent_at": 0.0}))


# ---------------------------------------------------------------- ids and strings


HELLO = {"actor_id": "mac-1.local:42", "host": "mac-1", "backend": "Device(gpu, 0)", "versions": {"mlx": "0.29"},
         "capacity": 1.0, "metrics_port": 0}
ROLLOUTS = encode(m.Rollouts(lease_id="0" * 32, policy_version=0, groups=[m.GroupResult(group_id="g00000001", completions=[
    m.Completion(tokens=m.Tensor.from_numpy(np.array([1], np.int32)), logprobs=m.Tensor.from_numpy(np.array([-1.0], np.float32)),
                 reward=0.0, finish_reason="stop")])]))
HOSTILE_TEXT = ["evil\r\n[ERROR] forged line", "\x1b[2J\x1b[31mred", "nul\x00byte", "tab\there", "caf\u00e9", "\u202egnp.exe"]


def test_the_learners_own_ids_pass() -> None:
    assert decode(envelope("Hello", HELLO)).actor_id == "mac-1.local:42"
    m.Lease(lease_id="", deadline_seconds=0.0, policy_version=0, prompts=[])
    m.Lease(lease_id="3f2b" * 8, deadline_seconds=1.0, policy_version=0, prompts=[])
    m.Ack(lease_id="L1", status="stale", reason="stale_version", groups={"g00000017": "stale"})


@pytest.mark.parametrize("text", HOSTILE_TEXT)
@pytest.mark.parametrize("field", ["actor_id", "host", "backend", "versions_key", "versions_value"])
def test_control_characters_in_hello_are_refused(field: str, text: str) -> None:
    if field.startswith("versions"):
        body = {**HELLO, "versions": {text: "1"} if field == "versions_key" else {"mlx": text}}
    else:
        body = {**HELLO, field: text}
    with pytest.raises(ProtocolError):
        decode(envelope("Hello", body))


@pytest.mark.parametrize("text", HOSTILE_TEXT + ["-leading-dash", "a" * 129])
@pytest.mark.parametrize("path", [("lease_id",), ("groups", 0, "group_id")])
def test_unsafe_lease_and_group_ids_are_refused(path: Path, text: str) -> None:
    if path == ("lease_id",) and text in ("-leading-dash",):
        return  # lease ids need no leading alphanumeric: they are only looked up, never shown bare
    body = msgpack.unpackb(ROLLOUTS)["body"]
    with pytest.raises(ProtocolError):
        decode(envelope("Rollouts", _replaced(body, path, text)))


@pytest.mark.parametrize("text, expected", [
    ("plain-id_1.2", "plain-id_1.2"),
    ("a\r\nb", "a\\x0d\\x0ab"),
    ("\x1b[2J", "\\x1b[2J"),
    ("nul\x00", "nul\\x00"),
    ("back\\slash", "back\\\\slash"),
    ("caf\u00e9 \u202e \U0001f600", "caf\\xe9 \\u202e \\U0001f600"),
    (b"id\x00", "b'id\\\\x00'"),
])
def test_shown_escapes_everything_but_printable_ascii(text: object, expected: str) -> None:
    assert shown(text) == expected


def test_shown_cuts_before_escaping() -> None:
    out = shown("\x00" * 10_000, limit=8)
    assert out == "\\x00" * 8 + "..."


# ---------------------------------------------------------------- lease-sized Rollouts


def _rollouts_body(groups: int, completions: int, tokens: int = 1) -> dict:
    completion = msgpack.unpackb(ROLLOUTS)["body"]["groups"][0]["completions"][0]
    completion = {**completion, "tokens": {"dtype": "int32", "shape": [tokens], "data": bytes(4 * tokens)},
                  "logprobs": {"dtype": "float32", "shape": [tokens], "data": np.full(tokens, -1.0, np.float32).tobytes()}}
    return {"lease_id": "0" * 32, "policy_version": 0,
            "groups": [{"group_id": f"g{i:08d}", "completions": [completion] * completions} for i in range(groups)]}


def test_rollouts_with_more_groups_or_completions_than_a_lease_are_refused_before_validation() -> None:
    limits = Limits(max_rollout_groups=2, max_group_completions=3)
    assert isinstance(decode(envelope("Rollouts", _rollouts_body(2, 3)), limits), m.Rollouts)
    for body in (_rollouts_body(3, 3), _rollouts_body(2, 4)):
        with pytest.raises(ProtocolError) as info:
            decode(envelope("Rollouts", body), limits)
        assert info.value.reason == "too_large"
    # Garbage items are not looked at: counting alone refuses the message.
    with pytest.raises(ProtocolError) as info:
        decode(envelope("Rollouts", {"lease_id": "", "policy_version": 0, "groups": [0, 1, 2]}), limits)
    assert info.value.reason == "too_large"


def test_inbound_limits_fit_the_largest_honest_rollouts_and_no_more() -> None:
    cfg = RunConfig.model_validate({"generation": {"group_size": 4, "max_tokens": 16},
                                    "server": {"max_groups_per_lease": 3}})
    limits = inbound_limits(cfg)
    largest = envelope("Rollouts", _rollouts_body(3, 4, tokens=16))
    assert len(largest) <= limits.max_message_bytes <= cfg.server.max_message_bytes
    assert isinstance(decode(largest, limits), m.Rollouts)
    hello = envelope("Hello", {**HELLO, "host": "h" * 256, "versions": {f"k{i}": "v" * 128 for i in range(32)}})
    assert isinstance(decode(hello, limits), m.Hello)
    # The 14 MB of one-token completions: refused on its size alone.
    with pytest.raises(ProtocolError) as info:
        decode(envelope("Rollouts", _rollouts_body(256, 390)), limits)
    assert info.value.reason == "too_large"


def test_inbound_limits_never_exceed_max_message_bytes() -> None:
    cfg = RunConfig.model_validate({"generation": {"group_size": 1024, "max_tokens": 32768},
                                    "server": {"max_groups_per_lease": 256, "max_message_bytes": 10 * 2**20}})
    assert inbound_limits(cfg).max_message_bytes == 10 * 2**20


@pytest.mark.parametrize("actor_id", ["mac 1", "evil\r\nid", "-dash"])
def test_an_actor_with_an_unsafe_id_fails_at_its_config_not_at_every_hello(actor_id: str) -> None:
    from pydantic import ValidationError

    from grpo_fleet.config import ActorConfig

    with pytest.raises(ValidationError):
        ActorConfig(actor_id=actor_id)
    assert ActorConfig(actor_id="mac-1.local@lab").actor_id == "mac-1.local@lab"


def test_token_rate_keeps_only_its_window_even_if_nobody_asks() -> None:
    from grpo_fleet.learner.actors.rates import RATE_WINDOW_SECONDS, TokenRate

    rate = TokenRate()
    for i in range(10_000):
        rate.add(10, now=i * 0.1)  # 1000 s of accepted groups, status never requested
    assert len(rate.events) <= RATE_WINDOW_SECONDS / 0.1 + 1
    assert rate.per_second(now=1000.0) == pytest.approx(100.0, rel=0.02)


@pytest.mark.parametrize("hostname", ["mac-1.local", "J\u00f6hn\u2019s Mac", "_weird\r\n", ""])
def test_the_default_actor_id_is_accepted_whatever_the_hostname(monkeypatch, hostname: str) -> None:
    from grpo_fleet.actor import worker

    monkeypatch.setattr(worker.socket, "gethostname", lambda: hostname)
    actor_id = worker.default_actor_id()
    assert decode(envelope("Hello", {**HELLO, "actor_id": actor_id, "host": shown(hostname)[:256]})).actor_id == actor_id
