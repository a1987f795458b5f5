"""A verifiers environment as a `task.env`: its own loop, env_response, stop conditions and rubric; our sampling.

    task.env = "grpo_fleet.envs.adapters.verifiers_env:VerifiersEnv"
    task.env_config = {env_id = "my-env", env_args = {difficulty = "easy"}}

`env_id` and `env_args` are what `vf.load_environment(env_id, **env_args)` takes:
the module named by the id (installed, as the Environments Hub installs them, or
on PYTHONPATH) exposes `load_environment(**kwargs)` returning a `vf.MultiTurnEnv`
(a `vf.ToolEnv`, `vf.SingleTurnEnv`, ...). It is loaded once per process.

- init(prompt) starts the environment's own rollout (verifiers.MultiTurnEnv.rollout)
  on the learner's prompt, the example's `answer` and `info`; the rollout's first
  request for a reply is the conversation.
- step(text) answers that request with the turn our policy sampled; verifiers
  appends it, checks its stop conditions, calls `env_response`, and asks again:
  the messages it added are the observations (done = false, reward 0). When the
  rollout ends instead, its rubric scores it (`rubric.score_rollout`) and that
  score is the step's reward, with done = true. The episode's reward is the rubric's.
- task.max_turns caps the environment's own `max_turns`, so verifiers ends the
  rollout there and scores it. An episode that task.max_episode_tokens ends first is
  never scored by the rubric: its reward is 0.

verifiers does not say whether an environment is deterministic, so `VerifiersEnv`
does not claim it: it trains with security.verify_rewards = false. When the same
replies always give the same messages and reward (no randomness, no model of its
own, no outside service), `DeterministicVerifiersEnv` says so, and the learner
replays every episode to check the actor's reward.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import sys
import threading
import types
import weakref
from typing import Any, Optional, Union

from grpo_fleet.envs.adapters import background_loop
from grpo_fleet.envs.adapters.verifiers_client import Turn, vf  # vf: a verifiers with MultiTurnEnv, checked there
from grpo_fleet.envs.adapters.verifiers_rollout import Finished, Rollout
from grpo_fleet.envs.protocol import EnvError

CONFIG_KEYS = ("env_id", "env_args")
# An id as vf.load_environment takes it ("my-env", "owner/my-env"), never a path: the module is imported by name.
ENV_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)?$")

_loaded: dict[str, concurrent.futures.Future[Any]] = {}  # this process's environments, by (env_id, env_args, max_turns)
_loading_lock = threading.Lock()
_loader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifiers-load")


def leave_signals_to_the_host() -> None:
    """verifiers' Environment takes SIGINT and SIGTERM for its teardown as it is built. In the environment process
    those are the host's (Ctrl-C is the parent's to handle, the parent stops the child), and on a worker thread
    `signal.signal` raises, so no environment could load there. Its module gets a `signal` that leaves them be
    (its atexit teardown still runs)."""
    module = sys.modules[vf.Environment.__module__]
    if getattr(module, "signal", None) is signal:
        host_owned = types.ModuleType("signal")
        host_owned.__dict__.update(signal.__dict__)
        host_owned.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[attr-defined]
        module.signal = host_owned  # type: ignore[attr-defined]


leave_signals_to_the_host()


def env_settings(env_config: Optional[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(env_id, env_args) from task.env_config, checked; EnvError says what is wrong, in one line."""
    config = dict(env_config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise EnvError(f"task.env_config for a verifiers environment takes env_id and env_args, not {unknown}")
    env_id, env_args = config.get("env_id"), config.get("env_args", {})
    if not isinstance(env_id, str) or not ENV_ID.match(env_id) or env_id.endswith(".py"):
        raise EnvError(f"task.env_config.env_id = {env_id!r}: the environment's id as vf.load_environment takes it "
                       "(an installed module, e.g. 'my-env'), not a file path")
    if not isinstance(env_args, dict):
        raise EnvError(f"task.env_config.env_args must be a table of load_environment's arguments, got {env_args!r}")
    return env_id, env_args


def load(env_id: str, env_args: dict[str, Any], max_turns: int) -> Any:
    """The environment, loaded once per process and checked for what a per-episode rollout can train.

    It loads on a thread of its own: episodes that start together wait for the one load, and a load longer than
    task.env_timeout_seconds fails the first episodes only (their calls are interrupted, not the load), so a large
    dataset does not fail every episode. A load that failed fails every episode of this process the same way."""
    key = json.dumps([env_id, env_args, max_turns], sort_keys=True, default=repr)
    with _loading_lock:
        if key not in _loaded:
            _loaded[key] = _loader.submit(lambda: checked(vf.load_environment(env_id, **env_args), env_id, max_turns))
    return background_loop.wait(_loaded[key])


def checked(env: Any, env_id: str, max_turns: int) -> Any:
    """Refuse what one episode at a time cannot run; cap the environment's turns at task.max_turns."""
    if not isinstance(env, vf.MultiTurnEnv):
        raise EnvError(f"verifiers environment {env_id!r} is a {type(env).__name__}, not a MultiTurnEnv (ToolEnv, "
                       "SingleTurnEnv, ...): only those roll out one turn at a time")
    if getattr(env, "requires_group_rollouts", False) or getattr(env, "provides_advantages", False):
        raise EnvError(f"verifiers environment {env_id!r} scores whole groups (group reward functions or "
                       "advantages): grpo-fleet scores each episode alone and computes advantages itself")
    if max_turns > 0 and not 0 < env.max_turns <= max_turns:
        env.max_turns = max_turns  # verifiers' own max_turns_reached then ends and scores the rollout
    return env


def rollout_input(prompt: list[dict[str, Any]], extras: dict[str, Any]) -> dict[str, Any]:
    """verifiers' RolloutInput from our prompt and the example's columns (answer, info, example_id)."""
    answer, info, example_id = extras.get("answer"), extras.get("info"), extras.get("example_id")
    return {"prompt": [dict(message) for message in prompt],
            "example_id": example_id if isinstance(example_id, int) and not isinstance(example_id, bool) else 0,
            "answer": "" if answer is None else str(answer), "info": info if isinstance(info, (dict, str)) else {}}


def cancel_soon(rollout: Rollout) -> None:
    if rollout.task is not None:
        background_loop.background_loop().call_soon_threadsafe(rollout.task.cancel)


class VerifiersEnv:
    """One episode of a verifiers environment (see the module docstring); not declared deterministic."""

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None) -> None:
        self.extras = dict(extras or {})
        env_id, env_args = env_settings(env_config)
        self.env = load(env_id, env_args, int(self.extras.get("max_turns") or 0))
        self.rollout: Optional[Rollout] = None
        self.sent: list[dict[str, Any]] = []  # the messages of the rollout's last request

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.rollout = Rollout(self.env, rollout_input(prompt, self.extras))
        # An episode the host drops without close (its call timed out) must not leave its rollout waiting forever.
        weakref.finalize(self, cancel_soon, self.rollout)
        event = background_loop.run(self.rollout.start())
        if not isinstance(event, Turn):
            raise EnvError("the verifiers rollout ended before asking for the model's first turn")
        self.sent = event.messages
        return list(event.messages), {}

    def step(self, action: str) -> dict[str, Any]:
        if self.rollout is None:
            raise EnvError("step before init")
        event: Union[Turn, Finished] = background_loop.run(self.rollout.answer(action))
        if isinstance(event, Turn):
            return {"observations": self._added(event.messages), "reward": 0.0, "done": False, "metadata": {}}
        state = event.state
        return {"observations": [], "reward": float(state.get("reward") or 0.0), "done": True,
                "metadata": {"stop_condition": state.get("stop_condition"), "metrics": state.get("metrics") or {}}}

    def close(self) -> None:
        if self.rollout is not None:
            background_loop.run(self.rollout.stop())

    def _added(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the environment added after our reply; the history before it must be what we have (token in,
        token out: the earlier turns are never rendered again)."""
        before = len(self.sent)
        if len(messages) <= before or messages[:before] != self.sent or messages[before]["role"] != "assistant":
            raise EnvError("the verifiers environment's next prompt does not continue the conversation (it rewrote "
                           "or dropped earlier messages); only a history that grows can be trained token in, token out")
        self.sent = messages
        return messages[before + 1:]


class DeterministicVerifiersEnv(VerifiersEnv):
    """The same, declared deterministic by you: the learner replays its episodes (security.verify_rewards)."""

    deterministic = True
