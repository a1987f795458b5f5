"""A shipped multi-turn environment: name a country's capital, with feedback and a second try.

    task.env = "grpo_fleet.envs.capital_quiz:CapitalQuiz"

The prompt asks "What is the capital of Kenya?" (the capitals data beside the
real-model demo). A reply that names the city ends the episode with reward 1.0.
A wrong one is told so, with a hint (the city's first two letters), and gets
another try, worth `second_try_reward` (0.5): the model gains by being right at
once, and learns from the hint when it is not. After `tries` tries (2) it ends
with 0. Written to skyrl-gym's interface and importing nothing from grpo_fleet,
as a user's environment would.

Measured on SmolLM2-135M-Instruct before training, through the episode runner
(the 32 held-out countries x 4 episodes, temperature 1, 16 tokens a turn, system
prompt "Answer in one short sentence."): right at the first try 0.38, at the
second try after a wrong first 0.13, at either 0.46; mean reward 0.42.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any, Optional


def _plain(text: str) -> str:
    """Lower case without accents, so "Bogota" matches "Bogotá"."""
    return "".join(ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch)).lower()


def names_city(reply: str, city: str) -> bool:
    """Whether the reply names the city as whole words."""
    return re.search(rf"\b{re.escape(_plain(city))}\b", _plain(reply)) is not None


class CapitalQuiz:
    """One question, up to `tries` answers; feedback with a hint after a wrong one."""

    # The same replies always get the same feedback and reward: the learner may replay its episodes to check them
    # (security.verify_rewards; learner/verify/env_replay.py).
    deterministic = True

    def __init__(self, env_config: Optional[dict[str, Any]] = None, extras: Optional[dict[str, Any]] = None) -> None:
        config, extras = dict(env_config or {}), dict(extras or {})
        self.city = str(extras["reward_spec"]["ground_truth"])
        self.tries = int(config.get("tries", 2))
        self.second_try_reward = float(config.get("second_try_reward", 0.5))
        self.question = "What is the capital?"
        self.turns = 0

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        self.question = users[-1] if users else self.question
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        if names_city(action, self.city):
            reward = 1.0 if self.turns == 1 else self.second_try_reward
            return {"observations": [], "reward": reward, "done": True, "metadata": {"tries": self.turns}}
        if self.turns >= self.tries:
            return {"observations": [], "reward": 0.0, "done": True, "metadata": {"tries": self.turns}}
        feedback = f"No, that is wrong. {self.question} Hint: it starts with {self.city[:2]}."
        return {"observations": [{"role": "user", "content": feedback}], "reward": 0.0, "done": False,
                "metadata": {}}
