"""Rewards for the Gemma 3 270M demo (demo.toml beside this file): the capital, alone, on the answer's line.

Gemma 3 270M is a base model: it continues text rather than answering. The
prompts are a quiz it continues ("Q: ...?\nA: Rome\nQ: ...?\nA:"),
so its answer is the first line of what it writes; what follows is the quiz going
on, and is not judged. Greedily it often names the right city; sampled at
temperature 1 it as often names another, adds words, or wanders. GRPO has a clear
thing to learn: the right city, and nothing else, on that line.
Every actor needs the same file (`--reward-module PATH`); the demo passes it for you.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from grpo_fleet.tasks import register_reward

# A word is a run of letters, with inner apostrophes or hyphens ("Port-au-Prince" is one word).
_WORD = re.compile(r"[^\W\d_]+(?:['\-][^\W\d_]+)*")


def _words(text: str) -> list[str]:
    """Lower-case words without accents, so "Bogota" matches "Bogotá"."""
    decomposed = unicodedata.normalize("NFKD", text)
    return _WORD.findall("".join(ch for ch in decomposed if not unicodedata.combining(ch)).lower())


def _answer_line(completion: str) -> list[str]:
    """The words of the reply's first line: the model's answer to the quiz question."""
    return _words(completion.lstrip(" ").split("\n", 1)[0])


@register_reward
def names_the_capital(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """1.0 when the answer line names the right city as whole words, else 0.0."""
    city, line = _words(answer), _answer_line(completion)
    return 1.0 if any(line[i : i + len(city)] == city for i in range(len(line) - len(city) + 1)) else 0.0


@register_reward
def only_the_capital(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """1.0 when the answer line is the city and nothing more ("Nairobi", "Nairobi."), else 0.0."""
    return 1.0 if _answer_line(completion) == _words(answer) else 0.0
