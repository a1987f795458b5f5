"""A step's episode figures (learner/run/episode_stats.py): turns, and the model's tool calls, for metrics.jsonl."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.run.episode_stats import episode_stats, turn_spans

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * 4"}}</tool_call>'
OBSERVATION = "<tool_response>\n12\n</tool_response>"


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def episode(*parts: tuple[str, int]) -> CompletionRecord:
    """An episode from (text, sampled) parts: sampled turns (1) and the environment's chunks (0), as characters."""
    tokens, mask, turns = [], [], []
    for text, sampled in parts:
        if sampled:
            turns.append(len(tokens))
        tokens += [ord(ch) for ch in text]
        mask += [sampled] * len(text)
    return CompletionRecord(np.array(tokens, np.int32), np.zeros(len(tokens), np.float32), 0.0, "stop",
                            mask=np.array(mask, np.uint8), turns=turns, end="done")


def group(*completions: CompletionRecord) -> AcceptedGroup:
    return AcceptedGroup("g", 0, np.array([1], np.int32), list(completions), 0, "actor")


def test_turns_and_well_formed_and_malformed_tool_calls_are_counted_per_episode() -> None:
    called = episode((CALL, 1), (OBSERVATION, 0), ("It is 12.", 1))
    broken = episode(('<tool_call>{"name": calc', 1), ("<tool_response>\nerror\n</tool_response>", 0), ("12", 1))
    alone = episode(("12, I think.", 1))
    stats = episode_stats([group(called, broken), group(alone)], decode)
    assert stats["episode_turns_mean"] == pytest.approx(5 / 3)
    assert stats["tool_calls_per_episode"] == pytest.approx(1 / 3)
    assert stats["tool_call_episode_fraction"] == pytest.approx(1 / 3)
    assert stats["tool_call_malformed_fraction"] == pytest.approx(1 / 2)


def test_a_turn_is_only_what_the_model_sampled() -> None:
    # The environment's chunk quotes a call: it is not the model's, so it is not counted.
    record = episode(("Let me see.", 1), (CALL, 0), ("12", 1))
    assert [decode(record.tokens[a:b].tolist()) for a, b in turn_spans(record)] == ["Let me see.", "12"]
    assert episode_stats([group(record)], decode)["tool_calls_per_episode"] == 0.0


def test_single_replies_have_no_episode_figures() -> None:
    single = CompletionRecord(np.array([65], np.int32), np.zeros(1, np.float32), 1.0, "stop")
    assert set(episode_stats([group(single)], decode).values()) == {None}
