"""Rewards for the real-model demo (demo.toml beside this file): name the capital, in one short sentence.

SmolLM2-135M-Instruct knows these capitals, but sampled at temperature 1 it
often wanders: a wrong city, a second sentence, a reply cut off at the token
budget. GRPO has a clear thing to learn: the right city, said once, finished.
Every actor needs the same file (`--reward-module PATH`); the demo passes it for you.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from grpo_fleet.tasks import register_reward

# A word is a run of letters, with inner apostrophes or hyphens ("Guinea-Bissau" is one word).
_WORD = re.compile(r"[^\W\d_]+(?:['\-][^\W\d_]+)*")


def _plain(text: str) -> str:
    """Lower case without accents, so "Bogota" matches "Bogotá"."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).lower()


def _words(text: str) -> list[str]:
    return _WORD.findall(_plain(text))


def _names(completion: str, answer: str) -> bool:
    """Whether the city's name appears in the reply as whole words."""
    city, reply = _words(answer), _words(completion)
    return any(reply[i : i + len(city)] == city for i in range(len(reply) - len(city) + 1))


@register_reward
def names_the_capital(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """1.0 when the reply names the right city anywhere, else 0.0."""
    return 1.0 if _names(completion, answer) else 0.0


@register_reward
def only_the_name(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """Words of the city over words in the reply, for a right answer: "Nairobi." scores 1.0,
    "The capital of Kenya is Nairobi." 1/6; a wrong answer 0.0 however short, so brevity alone earns nothing."""
    if not _names(completion, answer):
        return 0.0
    return len(_words(answer)) / len(_words(completion))


# One sentence: no terminal punctuation before the end, and the end is terminal punctuation.
_ONE_SENTENCE = re.compile(r"^[^.!?]+[.!?]$")


@register_reward
def one_short_sentence(completion: str, prompt: str, *, answer: str, **columns: Any) -> float:
    """1.0 for a right answer said in exactly one finished sentence ("The capital of Kenya is Nairobi."),
    else 0.0: a reply cut off at the token budget, or one that goes on after its first sentence, gets nothing."""
    text = completion.strip()
    return 1.0 if _names(text, answer) and _ONE_SENTENCE.match(text) else 0.0
