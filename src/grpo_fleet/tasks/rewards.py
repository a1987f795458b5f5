"""Named reward functions, and the one signature every reward has.

    reward(completion: str, prompt: str, *, answer: str, **columns) -> float | None

`completion` is the decoded completion (without its stop token), `prompt` the
prompt as the dataset gave it (for chat prompts, the last user message), and
every other dataset column arrives as a keyword argument under its own name;
`answer` is the reference answer as the task reads it (GSM8K's "#### 72" is
"72"). Return a float, or None for "this reward does not score this completion"
(see tasks/scoring.py for how None, errors and timeouts are treated).

Rewards are looked up by name so that actors, which only receive reward names,
weights and per-prompt columns over the wire, score completions exactly as the
learner would. A user's own rewards live in `task.reward_module`
(tasks/reward_module.py). Nothing here evaluates model output as code.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional, TypeVar, Union, overload

# (completion, prompt, *, answer, **columns) -> float | None; Callable cannot spell keyword arguments.
RewardFn = Callable[..., Optional[float]]
F = TypeVar("F", bound=RewardFn)

REWARDS: dict[str, RewardFn] = {}


class UnknownRewardError(KeyError):
    """A reward name that is not in the registry."""

    def __init__(self, name: str, note: str = "") -> None:
        known = ", ".join(sorted(REWARDS)) or "(none registered)"
        self.name = name
        self.message = f"unknown reward {name!r}{note}; known rewards: {known}"
        super().__init__(self.message)

    def __str__(self) -> str:
        # KeyError's default str() wraps the message in quotes, which reads badly in logs.
        return self.message


@overload
def register_reward(name_or_fn: str) -> Callable[[F], F]: ...
@overload
def register_reward(name_or_fn: F) -> F: ...
def register_reward(name_or_fn: Union[str, F]) -> Union[F, Callable[[F], F]]:
    """Add a reward to REWARDS: `@register_reward("name")`, or bare `@register_reward` for the function's own name."""
    if callable(name_or_fn):
        return _register(name_or_fn.__name__, name_or_fn)
    name = name_or_fn

    def decorator(fn: F) -> F:
        return _register(name, fn)

    return decorator


def _register(name: str, fn: F) -> F:
    if not name or len(name) > 64:
        raise ValueError(f"reward name {name!r} must be 1 to 64 characters")
    if name in REWARDS and REWARDS[name] is not fn:
        raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn
    return fn


def get_reward(name: str) -> RewardFn:
    """The reward function registered under `name`; UnknownRewardError if none."""
    try:
        return REWARDS[name]
    except KeyError:
        raise UnknownRewardError(name) from None


@register_reward("reverse_positions")
def reverse_positions(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """Fraction of positions that agree with the answer, over the longer of the two.

    Partial credit means a random policy already scores a little above zero, so
    GRPO groups have reward variance (and hence signal) from the first step.
    Dividing by the longer length penalises both truncated and padded outputs.
    """
    answer = answer.strip()
    text = completion.strip()
    longest = max(len(answer), len(text))
    if longest == 0:
        return 1.0
    matches = sum(1 for got, want in zip(text, answer) if got == want)
    return matches / longest


@register_reward("language_consistency")
def language_consistency(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """Share of the completion's characters that are printable ASCII (English text, maths, code).

    DeepSeek-R1's language-consistency reward, for English: it penalises
    drifting into other scripts or byte noise. It also gives a random-weight
    model graded rewards from its first sample, which is what the real-shape
    end-to-end test trains on. An empty completion scores 0.
    """
    if not completion:
        return 0.0
    return sum(" " <= ch <= "~" or ch in "\n\t" for ch in completion) / len(completion)


@register_reward("exact_match")
def exact_match(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """1.0 when the stripped completion equals the stripped answer."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


# Each block's body may not open or close a block of the same kind, so that
# "exactly one think block, then exactly one answer block" is what matches.
_R1_FORMAT = re.compile(
    r"<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>",
    re.DOTALL,
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Thousands separators must come in groups of three so "1,23" is not read as 123.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


@register_reward("r1_format")
def r1_format(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """1.0 for exactly `<think>...</think> <answer>...</answer>` and nothing else."""
    return 1.0 if _R1_FORMAT.fullmatch(completion.strip()) else 0.0


def parse_number(text: str) -> Optional[float]:
    """The single number in `text` ("$1,234.50.", "-7", "42 apples"), or None.

    Text with several numbers is ambiguous and yields None: otherwise a policy
    could list many candidates and be credited for whichever one we picked.
    """
    cleaned = text.strip().replace("$", "").rstrip(".").strip()
    found = _NUMBER.findall(cleaned)
    if len(found) != 1:
        return None
    value = float(found[0].replace(",", ""))
    return value if math.isfinite(value) else None


def gold_answer_text(answer: str) -> str:
    """The final answer of a GSM8K-style solution (after the last '####', commas dropped), else the whole text."""
    if "####" in answer:
        # GSM8K writes thousands with commas ("#### 1,800"); the number is what matters.
        return answer.rsplit("####", 1)[1].replace(",", "")
    return answer


def last_answer_tag(completion: str) -> Optional[str]:
    """Contents of the last `<answer>...</answer>` in `completion`, or None."""
    contents = _ANSWER_TAG.findall(completion)
    return contents[-1] if contents else None


@register_reward("r1_accuracy")
def r1_accuracy(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """1.0 when the last answer tag's contents equal the reference answer, as HF's math-verify reads them.

    math-verify reads expressions, LaTeX and spaced thousands ("5 * 3 + 3 = 18",
    "\\frac{36}{2}", "\\boxed{18}", "1 800"); with several numbers it takes the
    last ("41 or 42" reads 42). Where it finds no match, r1_accuracy_strict's
    single-number rule still credits the answer (math-verify does not read
    "+3"), so nothing the earlier rule credited is lost.
    """
    # Imported on first use: math-verify brings sympy and an ANTLR parser (about a second to import).
    from grpo_fleet.tasks.math_answers import answers_match

    content = last_answer_tag(completion)
    if content is not None and answers_match(content, gold_answer_text(answer)):
        return 1.0
    return r1_accuracy_strict(completion, answer=answer)


@register_reward("r1_accuracy_strict")
def r1_accuracy_strict(completion: str, prompt: str = "", *, answer: str = "", **columns: Any) -> float:
    """1.0 when the last answer tag holds exactly one number and it equals the reference number (no sympy)."""
    content = last_answer_tag(completion)
    if content is None:
        return 0.0
    predicted = parse_number(content)
    expected = parse_number(gold_answer_text(answer))
    if predicted is None or expected is None:
        return 0.0
    return 1.0 if abs(predicted - expected) <= 1e-6 else 0.0
