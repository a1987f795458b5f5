"""Admission: what an actor agrees to run (rewards, sampling, dtype, model path and digest).

Pure policy over the learner's `Welcome`: no sockets, nothing loaded. The learner
is trusted more than actors are, but not blindly: it names rewards (no code
crosses the wire), and a model the actor may only load from where it was allowed
to, with the same bytes as the learner's copy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, get_args

from grpo_fleet.actor.rollout import TruncatedSamplingError, refuse_truncated_sampling
from grpo_fleet.config import LoraConfig, ModelConfig
from grpo_fleet.model import model_digest
from grpo_fleet.protocol import messages as m
from grpo_fleet.realshape import local_copy
from grpo_fleet.tasks import UnknownRewardError, validate_rewards

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The dtypes a learner's config can name ([model] dtype); anything else is not a cast we agree to.
DTYPES = frozenset(get_args(get_args(ModelConfig.model_fields["dtype"].annotation)[0]))

# Same path, digest, adapters and dtype = the same model: loaded once.
ModelKey = tuple[str, str, str, Optional[str]]


class ActorRefused(Exception):
    """The learner asked for something this actor will not do (unknown reward, model outside allowed dirs)."""


@dataclass(frozen=True)
class ModelPlan:
    """An admitted model: where to load it from on this machine, and how."""

    key: ModelKey
    path: str
    lora: Optional[LoraConfig]
    dtype: Optional[str]


def model_key(ref: m.ModelRef) -> ModelKey:
    """What identifies the learner's model: a change in any part means loading it again."""
    return (ref.path, ref.digest, str(ref.lora), ref.dtype)


def model_path_allowed(path: str, model_dirs: list[str]) -> bool:
    """Hub ids are fine; a local path must resolve inside an allowed directory (cwd by default)."""
    local = Path(path).expanduser()
    if HUB_ID.match(path) and not local.exists():
        return True
    resolved = local.resolve()
    roots = [Path(d).expanduser().resolve() for d in (model_dirs or [os.getcwd()])]
    return any(resolved == root or root in resolved.parents for root in roots)


def check_run(welcome: m.Welcome) -> None:
    """Refuse a run this actor cannot serve faithfully: unknown rewards, nucleus sampling, a foreign dtype."""
    try:
        validate_rewards(welcome.reward.names, welcome.reward.weights)
    except UnknownRewardError as exc:
        raise ActorRefused(f"the learner asks for a reward this actor does not have: {exc}") from exc
    try:
        refuse_truncated_sampling(welcome.generation.top_p)
    except TruncatedSamplingError as exc:
        raise ActorRefused(str(exc)) from exc
    dtype = welcome.model.dtype
    if dtype and dtype not in DTYPES:
        # The name reaches getattr(mx, dtype): only the casts a config can ask for ("" = the default).
        raise ActorRefused(f"the learner asks for dtype {dtype!r}; this actor knows {sorted(DTYPES)}")


def local_model_path(path: str, model_dirs: list[str]) -> str:
    """Where to load the learner's model from: a real-shape model is (re)built in this machine's
    own cache, which needs no --model-dir; any other local path must be allowed."""
    built = local_copy(path)
    if built is not None:
        return str(built)
    if not model_path_allowed(path, model_dirs):
        raise ActorRefused(
            f"model path {path!r} is outside the allowed directories "
            f"{model_dirs or [os.getcwd()]}; pass --model-dir to allow it"
        )
    return path


def plan_model(ref: m.ModelRef, model_dirs: list[str], digest: Callable[[str], str] = model_digest) -> ModelPlan:
    """The model to load for `ref`, once its local copy is allowed and has the learner's digest."""
    path = local_model_path(ref.path, model_dirs)
    if digest(path) != ref.digest:
        raise ActorRefused(f"local copy of {ref.path} differs from the learner's (digest mismatch)")
    lora = LoraConfig.model_validate(ref.lora) if ref.lora else None
    return ModelPlan(key=model_key(ref), path=path, lora=lora, dtype=ref.dtype)


def admit(
    welcome: m.Welcome,
    model_dirs: list[str],
    loaded: Optional[ModelKey] = None,
    digest: Callable[[str], str] = model_digest,
) -> Optional[ModelPlan]:
    """Check a Welcome; the model to load, or None when `loaded` is already that model. Raises ActorRefused."""
    check_run(welcome)
    if model_key(welcome.model) == loaded:
        return None
    return plan_model(welcome.model, model_dirs, digest)
