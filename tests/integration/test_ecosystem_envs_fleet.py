"""Environments written for verifiers and for OpenEnv, by someone else, train 3 steps through the CLI: a learner and
an actor over TCP, with `task.env` naming the adapter and each episode replayed by the learner to check its reward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ecosystem_envs import OPENENV_ENV, VERIFIERS_ENV, write_module
from helpers import jsonl

DEMO = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"


def train_three_steps(run_config: Any, spawn: Any, model_dir: Path, modules: Path, data: dict[str, Any], env: str,
                      env_config: dict[str, Any]) -> Path:
    """A learner and an actor train 3 steps on `data`'s prompts with `env`; the run directory."""
    config, cfg = run_config(
        model={"path": str(model_dir)},
        task={**data, "rewards": [], "chat_template": True, "system_prompt": "Answer in one short sentence.",
              "env": env, "env_config": env_config, "max_turns": 2, "max_episode_tokens": 160,
              "env_timeout_seconds": 60.0},
        generation={"group_size": 4, "max_tokens": 6},
        train={"steps": 3, "eval_every": 0, "log_samples_every": 1, "checkpoint_every": 3},
        server={"lease_seconds": 60.0},
    )
    path = {"PYTHONPATH": str(modules)}  # the environment is an importable module, as an installed one is
    learner = spawn("learner", "--config", str(config), name="learner", env=path)
    actor = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "eco-0", "--metrics-port", "0",
                  "--model-dir", str(model_dir), name="actor", env=path)
    assert learner.wait(timeout=400) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=60) == 0, actor.log_path.read_text()[-3000:]
    log = learner.log_path.read_text()
    assert "mismatch" not in log and "invalid" not in log, log[-3000:]  # every episode replayed to the same reward
    return Path(cfg.run_dir)


def verifiers_dataset(modules: Path, monkeypatch: Any) -> dict[str, Any]:
    """The environment's own dataset, exported to JSONL as the manual says (its "prompt" column is chat messages)."""
    import verifiers as vf

    monkeypatch.syspath_prepend(str(modules))
    path = modules.parent / "vf_train.jsonl"
    vf.load_environment("vf-once-more").get_dataset().to_json(str(path))
    return {"name": "dataset", "dataset": str(path), "num_eval": 2}


def capitals(modules: Path, monkeypatch: Any) -> dict[str, Any]:
    return {"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl")}


def assert_trained_on_two_turn_episodes(run_dir: Path) -> None:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "event" not in line]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens"] > 0 for r in steps)
    samples = jsonl(run_dir / "samples.jsonl")
    assert samples and all([who for who, _ in row["turns"]] == ["model", "environment", "model"] and row["end"] == "done"
                           for row in samples)


ECOSYSTEMS = {  # extra -> (module name, its source, the prompts, task.env, task.env_config)
    "verifiers": ("vf_once_more", VERIFIERS_ENV, verifiers_dataset,
                  "grpo_fleet.envs.adapters.verifiers_env:DeterministicVerifiersEnv",
                  {"env_id": "vf-once-more", "env_args": {"max_turns": 2}}),
    "openenv": ("oe_length_echo", OPENENV_ENV, capitals, "grpo_fleet.envs.adapters.openenv_env:DeterministicOpenEnvEnv",
                {"environment": "oe_length_echo:LengthEcho", "env_args": {"turns": 2}}),
}


@pytest.mark.parametrize("extra", sorted(ECOSYSTEMS))
def test_an_environment_from_another_ecosystem_trains_three_steps(extra, run_config, spawn, tiny_chat_model_dir,
                                                                    tmp_path, monkeypatch):
    pytest.importorskip(extra, reason=f"the {extra} extra is not installed: pip install 'grpo-fleet[{extra}]'")
    module, source, prompts, env, env_config = ECOSYSTEMS[extra]
    modules = tmp_path / "modules"
    write_module(modules, module, source)
    run_dir = train_three_steps(run_config, spawn, tiny_chat_model_dir, modules, prompts(modules, monkeypatch), env,
                                env_config)
    assert_trained_on_two_turn_episodes(run_dir)
