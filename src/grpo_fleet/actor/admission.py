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

from grpo_fleet.config import LoraConfig, ModelConfig
from grpo_fleet.models.app_stores import is_app_path
from grpo_fleet.models.generation import TruncatedSamplingError, refuse_truncated_sampling
from grpo_fleet.models.gguf.importer import GGUFError
from grpo_fleet.models.loading import model_digest
from grpo_fleet.models.realshape import default_cache_dir, local_copy
from grpo_fleet.models.zoo import ZooError, import_source, is_gguf_source, is_zoo_path
from grpo_fleet.protocol import messages as m
from grpo_fleet.tasks import UnknownRewardError, validate_rewards
from grpo_fleet.tasks.reward_module import RewardModuleError, is_module_name, module_digest
from grpo_fleet.tasks.reward_runner import RewardSet

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
        if welcome.reward.module is None:  # built-ins only; a user's module is checked where it runs (its own process)
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
    own cache, and a zoo model fetched and imported there, which needs no --model-dir (both are pinned); an app's
    model (`ollama:`, `lmstudio:`) is taken from this machine's app folder, as its user pulled it, and imported too
    (its digest is checked against the learner's like any model's); any other local path must be allowed, and a
    GGUF file among them is imported into the cache once."""
    built = local_copy(path)
    if built is not None:
        return str(built)
    if not is_zoo_path(path) and not is_app_path(path) and not model_path_allowed(path, model_dirs):
        raise ActorRefused(
            f"model path {path!r} is outside the allowed directories "
            f"{model_dirs or [os.getcwd()]}; pass --model-dir to allow it"
        )
    if is_gguf_source(path):
        try:
            return str(import_source(path, default_cache_dir()))
        except (GGUFError, ZooError, OSError) as exc:
            raise ActorRefused(f"cannot import the learner's model {path!r} here: {exc}") from exc
    return path


def plan_model(ref: m.ModelRef, model_dirs: list[str], digest: Callable[[str], str] = model_digest) -> ModelPlan:
    """The model to load for `ref`, once its local copy is allowed and has the learner's digest."""
    path = local_model_path(ref.path, model_dirs)
    if digest(path) != ref.digest:
        raise ActorRefused(f"local copy of {ref.path} differs from the learner's (digest mismatch)")
    lora = LoraConfig.model_validate(ref.lora) if ref.lora else None
    return ModelPlan(key=model_key(ref), path=path, lora=lora, dtype=ref.dtype)


def local_reward_module(spec: m.RewardSpec, override: Optional[str], model_dirs: list[str]) -> Optional[str]:
    """This machine's copy of the learner's reward module, once it has the learner's digest.

    Importing a module runs it, so the actor imports only what its user named
    (--reward-module) or a file inside an allowed --model-dir.
    """
    if spec.module is None:
        return None
    if override is None and (is_module_name(spec.module) or not _inside(spec.module, model_dirs)):
        raise ActorRefused(
            f"the learner's rewards are in {spec.module!r}; start this actor with --reward-module naming this "
            "machine's copy of it (or keep the file inside a --model-dir)"
        )
    local = override or spec.module
    try:
        digest = module_digest(local)
    except RewardModuleError as exc:
        raise ActorRefused(f"this actor cannot read its reward module: {exc}") from exc
    if digest != spec.module_digest:
        raise ActorRefused(
            f"reward module {local!r} differs from the learner's {spec.module!r} (digest {digest[:12]} vs "
            f"{(spec.module_digest or '')[:12]}): give every Mac the same file"
        )
    return local


def _inside(path: str, model_dirs: list[str]) -> bool:
    resolved = Path(path).expanduser().resolve()
    roots = [Path(d).expanduser().resolve() for d in (model_dirs or [os.getcwd()])]
    return any(root in resolved.parents for root in roots)


def plan_rewards(spec: m.RewardSpec, override: Optional[str], model_dirs: list[str]) -> RewardSet:
    """What this actor scores with: the learner's rewards, from its own checked copy of the module."""
    return RewardSet(names=tuple(spec.names), weights=tuple(spec.weights),
                     module=local_reward_module(spec, override, model_dirs),
                     timeout_seconds=spec.timeout_seconds, bound=spec.bound)


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
