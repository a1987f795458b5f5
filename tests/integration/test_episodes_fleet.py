"""Episodes through the real fleet (issue 28): a learner and an actor, over TCP, train on the shipped CapitalQuiz."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import LENGTHS_ENV, jsonl

DEMO = Path(__file__).resolve().parents[2] / "src/grpo_fleet/demos/smollm2-135m-instruct"


def test_a_learner_and_an_actor_train_and_evaluate_episodes(run_config, spawn, tiny_chat_model_dir, tmp_path):
    env_file = tmp_path / "envs" / "lengths.py"
    env_file.parent.mkdir()
    env_file.write_text(LENGTHS_ENV)
    config, cfg = run_config(
        model={"path": str(tiny_chat_model_dir)},
        task={"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl"),
              "eval_path": str(DEMO / "capitals_eval.jsonl"), "rewards": [], "chat_template": True,
              "system_prompt": "Answer in one short sentence.", "env": f"{env_file}:Lengths",
              "max_turns": 2, "max_episode_tokens": 160},
        generation={"group_size": 4, "max_tokens": 6},
        train={"steps": 3, "eval_every": 3, "eval_mode": "sampled", "eval_samples": 2, "log_samples_every": 1,
               "checkpoint_every": 3},
        server={"lease_seconds": 60.0},
    )
    run_dir = Path(cfg.run_dir)
    learner = spawn("learner", "--config", str(config), name="learner")
    actor = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "quiz-0", "--metrics-port", "0",
                  "--model-dir", str(tiny_chat_model_dir), "--model-dir", str(env_file.parent), name="actor")
    assert learner.wait(timeout=400) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=60) == 0, actor.log_path.read_text()[-3000:]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "event" not in line]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(r["tokens"] > 0 for r in steps)
    rounds = [line for line in lines if line.get("event") == "eval"]
    assert [r["step"] for r in rounds] == [0, 3]
    assert all(r["scored"] == r["prompts"] and r["on_learner"] == 0 for r in rounds)  # the actor ran the held-out episodes
    samples = jsonl(run_dir / "samples.jsonl")
    assert samples and all([who for who, _ in row["turns"]] == ["model", "environment", "model"] and row["end"] == "done"
                           for row in samples)
    log = learner.log_path.read_text()
    assert "mismatch" not in log and "invalid" not in log  # every episode replayed to the same reward


def test_the_learner_refuses_an_environment_it_cannot_replay_in_one_line(run_config, spawn, tiny_chat_model_dir,
                                                                           tmp_path):
    env_file = tmp_path / "lengths.py"
    env_file.write_text(LENGTHS_ENV.replace("    deterministic = True\n", ""))
    config, _ = run_config(
        model={"path": str(tiny_chat_model_dir)},
        task={"name": "jsonl", "train_path": str(DEMO / "capitals_train.jsonl"), "rewards": [], "chat_template": True,
              "env": f"{env_file}:Lengths"})
    learner = spawn("learner", "--config", str(config), name="learner")
    assert learner.wait(timeout=120) == 2
    log = learner.log_path.read_text()
    assert "does not declare itself deterministic" in log and "Traceback" not in log, log[-3000:]
