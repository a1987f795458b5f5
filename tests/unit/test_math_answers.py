"""The GSM8K accuracy reward against realistic answers, math-verify off the main thread, and costly answers."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_fleet.tasks.math_answers import answers_match, is_cheap
from grpo_fleet.tasks.rewards import r1_accuracy, r1_accuracy_strict

# (answer-tag contents, GSM8K gold, correct?): forms a policy really writes.
ANSWER_TABLE = [
    ("5 * 3 + 3 = 18", "#### 18", True),
    ("\\frac{36}{2}", "#### 18", True),
    ("18 (3 * 6 = 18)", "#### 18", True),
    ("$18", "#### 18", True),
    ("\\boxed{18}", "#### 18", True),
    ("x = 18", "#### 18", True),
    ("18%", "#### 18", True),
    ("17", "#### 18", False),
    ("1,800", "#### 1,800", True),
    ("1 800", "#### 1,800", True),
]


def completion(content: str) -> str:
    return f"<think>work it out</think><answer>{content}</answer>"


def errors(reward) -> tuple[int, int]:
    """(false negatives, false positives) of a reward over ANSWER_TABLE."""
    scores = [(reward(completion(content), answer=gold), correct) for content, gold, correct in ANSWER_TABLE]
    misses = sum(score == 0.0 and correct for score, correct in scores)
    wrong = sum(score == 1.0 and not correct for score, correct in scores)
    return misses, wrong


@pytest.mark.parametrize(("content", "gold", "correct"), ANSWER_TABLE)
def test_r1_accuracy_scores_realistic_answers(content: str, gold: str, correct: bool) -> None:
    assert r1_accuracy(completion(content), answer=gold) == (1.0 if correct else 0.0)


def test_math_verify_removes_the_strict_rules_false_negatives() -> None:
    # The strict single-number rule misses "5 * 3 + 3 = 18", "\frac{36}{2}", "18 (3 * 6 = 18)" and "1 800".
    assert errors(r1_accuracy_strict) == (4, 0)
    assert errors(r1_accuracy) == (0, 0)


def test_reward_off_the_main_thread_matches_the_main_thread() -> None:
    """math-verify's signal.alarm timeouts raise off the main thread; the reward must not."""
    on_main = [r1_accuracy(completion(content), answer=gold) for content, gold, _ in ANSWER_TABLE]
    with ThreadPoolExecutor(max_workers=2) as pool:
        off_main = list(pool.map(lambda row: r1_accuracy(completion(row[0]), answer=row[1]), ANSWER_TABLE))
    assert off_main == on_main


@pytest.mark.parametrize(
    "content",
    ["9^9^9^9", "$10^{10^{10}}$", "\\boxed{9^{9^{9}}}", "$(10^{10})!$", "$1000000!$", "$\\Gamma(10^{9})$",
     "\\boxed{\\binom{10^{9}}{10^{5}}}", "$\\sum_{i=1}^{10^{10}} i$", "((2^1000)^1000)^1000", "x" * 2000],
)
def test_costly_answers_score_zero_quickly_off_the_main_thread(content: str) -> None:
    """Without signal timeouts these would keep sympy busy for ever; the screen refuses them first."""
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(answers_match(content, "18")), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), f"{content!r} still being compared after 20 s"
    assert result == [False]
    assert time.monotonic() - started < 5


def test_cheap_answers_pass_the_screen() -> None:
    assert answers_match("$\\sqrt{324}$", "18")
    assert answers_match("$6!$", "720")
    assert answers_match("$2^{10}$", "1024")
    assert answers_match("$\\binom{18}{1}$", "18")
    assert is_cheap("18")  # math-verify's string form is not sympy


def test_screen_refuses_non_finite_exponents_and_arguments() -> None:
    import sympy

    assert not is_cheap(sympy.Pow(2, sympy.nan, evaluate=False))
    assert not is_cheap(sympy.Pow(2, sympy.oo, evaluate=False))
    assert not is_cheap(sympy.factorial(sympy.nan, evaluate=False))
    assert is_cheap(sympy.Pow(2, sympy.Rational(1, 2), evaluate=False))


def test_unreadable_gold_never_matches() -> None:
    assert not answers_match("18", "no number here")
