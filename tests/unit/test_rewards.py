"""Reward functions and the reward registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_fleet.tasks import rewards
from grpo_fleet.tasks.rewards import (
    REWARDS,
    UnknownRewardError,
    exact_match,
    get_reward,
    gold_answer_text,
    parse_number,
    r1_accuracy,
    r1_accuracy_strict,
    r1_format,
    register_reward,
    reverse_positions,
)


def fields(answer: str) -> dict[str, str]:
    """The keyword arguments a reward gets for a row with only an answer."""
    return {"answer": answer}


# --- registry -----------------------------------------------------------------


def test_builtin_rewards_are_registered() -> None:
    assert {"reverse_positions", "exact_match", "r1_format", "r1_accuracy", "r1_accuracy_strict"} <= set(REWARDS)
    assert get_reward("exact_match") is exact_match


def test_unknown_reward_error_names_it_and_lists_known() -> None:
    with pytest.raises(UnknownRewardError) as info:
        get_reward("no_such_reward")
    message = str(info.value)
    assert "no_such_reward" in message
    assert "exact_match" in message and "reverse_positions" in message
    assert isinstance(info.value, KeyError)


def test_register_reward_adds_and_rejects_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))

    @rewards.register_reward("always_half")
    def always_half(completion: str, prompt: str, **columns: object) -> float:
        return 0.5

    assert rewards.get_reward("always_half")("x", "p") == 0.5
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("always_half")(lambda completion, prompt, **columns: 0.0)


def test_register_reward_is_idempotent_for_same_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rewards, "REWARDS", dict(REWARDS))
    assert register_reward("exact_match")(exact_match) is exact_match


# --- reverse_positions ---------------------------------------------------------


def test_reverse_positions_exact_match_is_one() -> None:
    assert reverse_positions("284", "", **fields("284")) == 1.0


def test_reverse_positions_strips_whitespace() -> None:
    assert reverse_positions("  284\n", "", **fields("284")) == 1.0


def test_reverse_positions_partial_credit() -> None:
    assert reverse_positions("294", "", **fields("284")) == pytest.approx(2 / 3)
    assert reverse_positions("28", "", **fields("284")) == pytest.approx(2 / 3)
    # Padding is penalised by dividing by the longer length.
    assert reverse_positions("2840", "", **fields("284")) == pytest.approx(3 / 4)


def test_reverse_positions_zero_cases() -> None:
    assert reverse_positions("", "", **fields("284")) == 0.0
    assert reverse_positions("   ", "", **fields("284")) == 0.0
    assert reverse_positions("999", "", **fields("284")) == 0.0
    # Right characters in shifted positions earn nothing.
    assert reverse_positions("X284", "", **fields("284")) == 0.0


digit_text = st.text(alphabet="0123456789=x ", max_size=12)


@settings(max_examples=200, deadline=None)
@given(completion=digit_text, answer=st.text(alphabet="0123456789", min_size=1, max_size=12))
def test_reverse_positions_bounded_and_one_iff_exact(completion: str, answer: str) -> None:
    score = reverse_positions(completion, "", **fields(answer))
    assert 0.0 <= score <= 1.0
    assert (score == 1.0) == (completion.strip() == answer)


# --- exact_match ---------------------------------------------------------------


def test_exact_match() -> None:
    assert exact_match(" 42 \n", "", **fields("42")) == 1.0
    assert exact_match("42", "", **fields(" 42 ")) == 1.0
    assert exact_match("42.0", "", **fields("42")) == 0.0
    assert exact_match("", "", **fields("42")) == 0.0


# --- r1_format -----------------------------------------------------------------


@pytest.mark.parametrize(
    "completion",
    [
        "<think>add them</think><answer>5</answer>",
        "<think>\nmulti\nline\n</think>\n\n<answer>\n5\n</answer>",
        "  <think></think> <answer></answer>\n",
    ],
)
def test_r1_format_accepts(completion: str) -> None:
    assert r1_format(completion, "", **fields("5")) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "5",
        "<answer>5</answer>",
        "<think>x</think>",
        "<think>x</think> 5",
        "<think>x</think><answer>5</answer> extra",
        "preamble <think>x</think><answer>5</answer>",
        "<answer>5</answer><think>x</think>",
        "<think>x</think>text<answer>5</answer>",
        "<think>x</think><answer>5</answer><answer>6</answer>",
        "<think>a</think><think>b</think><answer>5</answer>",
        "<think>x<answer>5</answer>",
    ],
)
def test_r1_format_rejects(completion: str) -> None:
    assert r1_format(completion, "", **fields("5")) == 0.0


# --- r1_accuracy ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "gold"),
    [
        ("42", "42"),
        (" 42 ", "#### 42"),
        ("1,234", "1234"),
        ("$1,234.00", "1234"),
        ("42.", "42"),
        ("-7", "-7"),
        ("+3", "3"),
        ("0.5", ".5"),
        ("2.50", "2.5"),
        ("42 apples", "42"),
        ("$-5", "-5"),
    ],
)
def test_r1_accuracy_matches_numerically(content: str, gold: str) -> None:
    completion = f"<think>working</think><answer>{content}</answer>"
    assert r1_accuracy(completion, "", **fields(gold)) == 1.0


def test_r1_accuracy_reads_gsm8k_style_gold() -> None:
    gold = "She has 3 * 4 = 12 apples, then 12 + 30 = 42.\n#### 42"
    assert r1_accuracy("<answer>42</answer>", "", **fields(gold)) == 1.0
    assert r1_accuracy("<answer>12</answer>", "", **fields(gold)) == 0.0


def test_r1_accuracy_uses_last_answer_tag() -> None:
    completion = "<answer>41</answer> no wait <answer>42</answer>"
    assert r1_accuracy(completion, "", **fields("42")) == 1.0
    assert r1_accuracy("<answer>42</answer><answer>41</answer>", "", **fields("42")) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "42",
        "",
        "<answer>43</answer>",
        "<answer></answer>",
        "<answer>forty-two</answer>",
        "<answer>42 or 41</answer>",
        "<answer>42",
        "<think>42</think>",
    ],
)
def test_r1_accuracy_rejects(completion: str) -> None:
    assert r1_accuracy(completion, "", **fields("#### 42")) == 0.0


def test_r1_accuracy_reads_the_last_of_several_numbers_as_math_verify_does() -> None:
    assert r1_accuracy("<answer>41 or 42</answer>", "", **fields("#### 42")) == 1.0
    assert r1_accuracy("<answer>42 or 41</answer>", "", **fields("#### 42")) == 0.0
    # The strict rule refuses any answer with more than one number.
    assert r1_accuracy_strict("<answer>41 or 42</answer>", "", **fields("#### 42")) == 0.0


def test_r1_accuracy_unparseable_gold_scores_zero() -> None:
    assert r1_accuracy("<answer>42</answer>", "", **fields("no number here")) == 0.0


def test_r1_accuracy_tolerance() -> None:
    assert r1_accuracy("<answer>0.1</answer>", "", **fields("0.1000000001")) == 1.0
    assert r1_accuracy("<answer>0.1</answer>", "", **fields("0.11")) == 0.0


# --- helpers -------------------------------------------------------------------


def test_parse_number() -> None:
    assert parse_number("$1,234,567.5.") == 1234567.5
    assert parse_number("-0.25") == -0.25
    assert parse_number("") is None
    assert parse_number("1 2") is None
    assert parse_number("abc") is None


def test_gold_answer_text_takes_text_after_last_marker() -> None:
    assert gold_answer_text("work #### 1 #### 2").strip() == "2"
    assert gold_answer_text("17") == "17"
    assert gold_answer_text("20 * 90 = 1800\n#### 1,800").strip() == "1800"


def test_language_consistency_is_the_printable_ascii_share() -> None:
    from grpo_fleet.tasks.rewards import language_consistency

    assert language_consistency("The answer is 42.\n", {}) == 1.0
    assert language_consistency("答案是 42", {}) == pytest.approx(3 / 6)
    assert language_consistency("\x1b[31m", {}) == pytest.approx(4 / 5)
    assert language_consistency("", {}) == 0.0
