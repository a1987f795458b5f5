"""The GSM8K recipe of docs/several-macs.md (configs/qwen2.5-0.5b-gsm8k-mac.toml) end to end on the self-built tiny model.

A local `datasets` dataset in GSM8K's shape, a user reward file, eval leases and
samples, real processes; an actor with a different copy of the reward file is refused.
"""

from __future__ import annotations

from pathlib import Path

from helpers import audit_ledger, jsonl
from recipe_helpers import BREVITY_REWARD, recipe_config, save_gsm8k_like

USER_REWARDS = '''
from grpo_fleet.tasks import register_reward

@register_reward
def by_level(completion, prompt, *, answer, level, **columns):
    """A reward that reads a dataset column: every completion of a level-n question scores 0.001 * (n + 1)."""
    return 0.001 * (level + 1)
''' + BREVITY_REWARD
# brevity: the tiny model's groups differ, so they train (recipe_helpers.BREVITY_REWARD).
REWARDS = {"r1_format": 0.2, "r1_accuracy": 1.0, "by_level": 1.0, "reverse_positions": 0.1, "brevity": 0.1}


def test_the_gsm8k_recipe_trains_with_user_rewards_eval_leases_and_samples(spawn, free_port, tmp_path):
    dataset = save_gsm8k_like(tmp_path / "gsm8k")
    rewards_file = tmp_path / "my_rewards.py"
    rewards_file.write_text(USER_REWARDS)
    config, cfg = recipe_config(tmp_path, free_port, dataset, rewards_file, REWARDS)
    assert cfg["train"]["eval_mode"] == "sampled" and cfg["task"]["chat_template"], "the recipe's own settings"
    run_dir = Path(cfg["run_dir"])
    learner = spawn("learner", "--config", str(config), name="learner")

    # Another Mac with an edited copy of the reward file is refused, and says why.
    edited = tmp_path / "edited" / "my_rewards.py"
    edited.parent.mkdir()
    edited.write_text(USER_REWARDS.replace("0.001", "0.002"))
    stale_copy = spawn("actor", "--connect", cfg["server"]["bind"], "--metrics-port", "0", "--model-dir", str(run_dir),
                       "--reward-module", str(edited), name="stale-actor")
    assert stale_copy.wait(timeout=120) != 0
    assert "differs from the learner's" in stale_copy.log_path.read_text()

    actor = spawn("actor", "--connect", cfg["server"]["bind"], "--metrics-port", "0", "--model-dir", str(run_dir),
                  "--reward-module", str(rewards_file), name="actor")
    assert learner.wait(timeout=300) == 0, learner.log_path.read_text()[-3000:]
    assert actor.wait(timeout=60) == 0, actor.log_path.read_text()[-3000:]

    lines = jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in lines if "event" not in r]
    rounds = [r for r in lines if r.get("event") == "eval"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["step"] for r in rounds] == [0, 2, 4], "step 0, every eval_every, and the end"
    for round_ in rounds:
        assert (round_["scored"], round_["k"], round_["mode"]) == (4, 2, "sampled")
        # The held-out levels are 100..103: by_level alone gives 0.101..0.104 (the tiny model earns no R1 credit).
        assert 0.101 - 1e-6 <= round_["eval_reward"]
    assert len(audit_ledger(run_dir / "ledger.jsonl").accepted) >= 8, "eval work never enters the ledger"

    samples = jsonl(run_dir / "samples.jsonl")
    assert {row["step"] for row in samples} == {1, 2, 3, 4}
    for row in samples:
        assert row["reward"] >= 0.001 * (row["prompt_index"] + 1) - 1e-6, "the user's reward read the level column"
        assert row["completion"] and row["prompt"]
