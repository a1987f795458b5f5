"""Example user rewards for configs/qwen2.5-0.5b-gsm8k-mac.toml (task.reward_module).

Every actor Mac needs the same file: start each actor with
`--reward-module configs/gsm8k_rewards.py`; the learner checks the copies by digest.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from grpo_fleet.tasks import register_reward

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
# Beyond this many characters of reasoning, credit falls off linearly to 0 at twice as many.
THINK_BUDGET_CHARS = 1200


@register_reward
def concise_reasoning(completion: str, prompt: str, *, answer: str, **columns: Any) -> Optional[float]:
    """1.0 for reasoning within the budget, less for rambling; None (no opinion) without a <think> block."""
    found = _THINK.search(completion)
    if found is None:
        return None
    length = len(found.group(1))
    if length <= THINK_BUDGET_CHARS:
        return 1.0
    return max(0.0, 2.0 - length / THINK_BUDGET_CHARS)
