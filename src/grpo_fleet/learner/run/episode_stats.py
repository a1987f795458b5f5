"""A step's episode figures for metrics.jsonl and curves.png: turns per episode, and the model's tool calls.

Prometheus has the actors' episode counters; a run's own record needs them per
step, beside its reward, to show a tool-use recipe learning to call its tool.
A turn's text is its sampled ids decoded once, as the environment was given it;
a call is read with the ready-made `<tool_call>` convention (envs/tools.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from grpo_fleet.envs.tools import ToolCallError, parse_tool_call
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord


def turn_spans(record: CompletionRecord) -> list[tuple[int, int]]:
    """(start, end) of each sampled turn of an episode: from its offset while the mask stays 1."""
    assert record.mask is not None and record.turns is not None
    spans = []
    for start in record.turns:
        end = start
        while end < len(record.mask) and record.mask[end]:
            end += 1
        spans.append((start, end))
    return spans


def _calls(text: str) -> tuple[int, int]:
    """(well-formed, malformed) tool calls in one turn (at most one of them: a turn makes one call)."""
    try:
        return (0, 0) if parse_tool_call(text) is None else (1, 0)
    except ToolCallError:
        return 0, 1


def episode_stats(groups: list[AcceptedGroup], decode: Callable[[list[int]], str]) -> dict[str, Optional[float]]:
    """Turns per episode, well-formed tool calls per episode, the share of episodes with one, and the share of
    attempted calls that were malformed; all None in a batch of single replies."""
    episodes = [c for g in groups for c in g.completions if c.mask is not None and c.turns is not None]
    if not episodes:
        return {"episode_turns_mean": None, "tool_calls_per_episode": None, "tool_call_episode_fraction": None,
                "tool_call_malformed_fraction": None}
    counts = np.array([_episode_calls(c, decode) for c in episodes])  # [episodes, 2]
    attempts = int(counts.sum())
    return {"episode_turns_mean": float(np.mean([len(c.turns or []) for c in episodes])),
            "tool_calls_per_episode": float(counts[:, 0].mean()),
            "tool_call_episode_fraction": float(np.mean(counts[:, 0] > 0)),
            "tool_call_malformed_fraction": float(counts[:, 1].sum() / attempts) if attempts else None}


def _episode_calls(record: CompletionRecord, decode: Callable[[list[int]], str]) -> tuple[int, int]:
    found = [_calls(decode(record.tokens[start:end].tolist())) for start, end in turn_spans(record)]
    return sum(ok for ok, _ in found), sum(bad for _, bad in found)


def turn_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """A turn's ids as text, without special tokens (its stop token among them)."""
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))
