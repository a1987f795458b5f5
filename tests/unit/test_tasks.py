"""Task construction: the synthetic reversal task, JSONL loading and scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_fleet.config import TaskConfig
from grpo_fleet.tasks import (
    Example,
    Task,
    UnknownRewardError,
    build_task,
    data_path,
    resolve_task_path,
    validate_rewards,
)
from grpo_fleet.tasks.jsonl import load_jsonl
from grpo_fleet.tasks.reverse import (
    make_reverse_examples,
    make_reverse_splits,
)

# --- reverse --------------------------------------------------------------------


def test_reverse_example_format() -> None:
    examples = make_reverse_examples(50, digits=3, seed=0)
    for example in examples:
        assert example.prompt.endswith("=")
        number = example.prompt[:-1]
        assert len(number) == 3 and number.isdigit()
        assert example.answer == number[::-1]


def test_reverse_examples_are_distinct_and_deterministic() -> None:
    first = make_reverse_examples(200, digits=3, seed=7)
    assert first == make_reverse_examples(200, digits=3, seed=7)
    assert len({example.prompt for example in first}) == 200
    assert first != make_reverse_examples(200, digits=3, seed=8)


def test_reverse_examples_can_fill_the_whole_space() -> None:
    examples = make_reverse_examples(10, digits=1, seed=0)
    assert sorted(example.prompt for example in examples) == [f"{d}=" for d in range(10)]


def test_reverse_examples_respect_exclude() -> None:
    excluded = {f"{d}=" for d in range(6)}
    examples = make_reverse_examples(4, digits=1, seed=3, exclude=excluded)
    assert sorted(example.prompt for example in examples) == ["6=", "7=", "8=", "9="]
    with pytest.raises(ValueError, match="excluded"):
        make_reverse_examples(5, digits=1, seed=3, exclude=excluded)


def test_reverse_examples_large_digit_counts_are_cheap() -> None:
    examples = make_reverse_examples(100, digits=12, seed=0)
    assert len({example.prompt for example in examples}) == 100
    assert all(len(example.prompt) == 13 for example in examples)


def test_reverse_splits_too_many_raises() -> None:
    with pytest.raises(ValueError, match="only 100 2-digit prompts exist"):
        make_reverse_splits(num_train=90, num_eval=11, digits=2, seed=0)


def test_reverse_eval_split_independent_of_train_size() -> None:
    _, eval_small = make_reverse_splits(num_train=10, num_eval=20, digits=4, seed=1)
    _, eval_large = make_reverse_splits(num_train=500, num_eval=20, digits=4, seed=1)
    assert eval_small == eval_large


# --- build_task: reverse ------------------------------------------------------------


def test_build_reverse_task_sizes_and_disjoint_splits() -> None:
    task = build_task(TaskConfig(name="reverse", digits=3, num_train=300, num_eval=50, seed=0))
    assert task.name == "reverse"
    assert len(task.train) == 300 and len(task.eval) == 50
    train_prompts = {example.prompt for example in task.train}
    eval_prompts = {example.prompt for example in task.eval}
    assert len(train_prompts) == 300
    assert not train_prompts & eval_prompts
    assert task.reward_names == ["reverse_positions"]
    assert task.reward_weights == [1.0]


def test_build_reverse_task_deterministic_per_seed() -> None:
    config = TaskConfig(name="reverse", digits=3, num_train=100, num_eval=20, seed=5)
    assert build_task(config) == build_task(config)
    other = build_task(config.model_copy(update={"seed": 6}))
    assert other.train != build_task(config).train


def test_build_reverse_task_exact_fit_and_overflow() -> None:
    task = build_task(TaskConfig(name="reverse", digits=1, num_train=7, num_eval=3))
    assert {example.prompt for example in task.train + task.eval} == {f"{d}=" for d in range(10)}
    with pytest.raises(ValueError, match="only 10 1-digit prompts exist"):
        build_task(TaskConfig(name="reverse", digits=1, num_train=8, num_eval=3))


def test_build_task_rejects_unknown_reward_before_loading_data(tmp_path: Path) -> None:
    config = TaskConfig(name="jsonl", train_path=str(tmp_path / "missing.jsonl"), rewards=["exact_match", "bogus"])
    with pytest.raises(UnknownRewardError) as info:
        build_task(config)
    assert "bogus" in str(info.value) and "r1_accuracy" in str(info.value)


# --- scoring ----------------------------------------------------------------------


def test_task_fields_and_score() -> None:
    task = build_task(TaskConfig(num_train=10, num_eval=5))
    example = task.train[0]
    assert task.fields(example) == {"answer": example.answer}
    assert task.score(example.answer, example) == 1.0
    assert task.score("", example) == 0.0


def gsm8k_task(weights: list[float]) -> Task:
    return Task(name="t", train=[], eval=[], reward_names=["r1_format", "r1_accuracy"], reward_weights=weights)


def test_task_score_weights() -> None:
    completion = "<think>6*7</think><answer>42</answer>"
    example = Example(prompt="q", answer="#### 42")
    assert gsm8k_task([0.5, 2.0]).score(completion, example) == pytest.approx(2.5)
    assert gsm8k_task([1.0, 1.0]).score(completion, example) == pytest.approx(2.0)
    assert gsm8k_task([0.5, 2.0]).score("<answer>41</answer>", example) == 0.0
    assert gsm8k_task([1.0, 1.0]).score("<answer>42</answer>", example) == pytest.approx(1.0)


def test_validate_rewards_checks_names_and_weights() -> None:
    with pytest.raises(UnknownRewardError):
        validate_rewards(["nope"], None)
    with pytest.raises(ValueError, match="one weight per reward"):
        validate_rewards(["exact_match"], [1.0, 2.0])


def test_task_score_uses_configured_weights() -> None:
    task = Task(
        name="t",
        train=[],
        eval=[],
        reward_names=["exact_match", "reverse_positions"],
        reward_weights=[3.0, 1.0],
    )
    assert task.score("123", Example(prompt="p", answer="123")) == pytest.approx(4.0)
    assert task.score("124", Example(prompt="p", answer="123")) == pytest.approx(2 / 3)


# --- jsonl ------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_prompt_and_gsm8k_keys(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"prompt": "2+2?", "answer": "4"}),
            "",
            "   ",
            json.dumps({"prompt": "3*3?", "answer": 9}),
            json.dumps({"question": "Half of 5?", "answer": 2.5}),
            json.dumps({"question": "Q", "answer": "work\n#### 7", "extra": [1]}),
        ],
    )
    assert load_jsonl(path) == [
        Example("2+2?", "4"),
        Example("3*3?", "9"),
        Example("Half of 5?", "2.5"),
        Example("Q", "work\n#### 7"),
    ]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ("{not json", "invalid JSON"),
        ('["prompt", "answer"]', "JSON object"),
        ('{"answer": "1"}', "missing key 'prompt'"),
        ('{"prompt": "p"}', "missing key 'answer'"),
        ('{"prompt": 5, "answer": "1"}', "'prompt' must be a string"),
        ('{"prompt": "  ", "answer": "1"}', "'prompt' is empty"),
        ('{"prompt": "p", "answer": null}', "'answer' must be a string or a number"),
        ('{"prompt": "p", "answer": true}', "'answer' must be a string or a number"),
        ('{"question": ["q"], "answer": "1"}', "'question'[0] must be"),
        ('{"prompt": {"role": "user"}, "answer": "1"}', "'prompt' must be a string or a list of messages"),
        ('{"prompt": [], "answer": "1"}', "must end with the user's message"),
        ('{"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"}',
         "must end with the user's message"),
        ('{"prompt": [{"role": "tool", "content": "q"}], "answer": "1"}', "'prompt'[0] must be"),
        ('{"prompt": [{"role": "user", "content": "q", "name": "x"}], "answer": "1"}', "'prompt'[0] must be"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path: Path, bad_line: str, problem: str) -> None:
    good = json.dumps({"prompt": "ok", "answer": "1"})
    path = write_lines(tmp_path / "bad.jsonl", [good, "", bad_line, good])
    with pytest.raises(ValueError) as info:
        load_jsonl(path)
    message = str(info.value)
    assert "bad.jsonl:3:" in message
    assert problem in message


def test_a_jsonl_prompt_may_be_a_conversation_ending_with_the_users_message(tmp_path: Path) -> None:
    shot = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "3 + 3?"}]
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps({"prompt": shot, "answer": "6"})])
    (example,) = load_jsonl(path)
    assert example.prompt == tuple(shot) and example.answer == "6"


def test_load_jsonl_accepts_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "p", "answer": "a"}).encode())
    assert load_jsonl(path) == [Example("p", "a")]


# --- build_task: jsonl --------------------------------------------------------------


def make_jsonl(path: Path, count: int) -> Path:
    return write_lines(path, [json.dumps({"prompt": f"p{i}", "answer": str(i)}) for i in range(count)])


def test_build_jsonl_task_holds_out_rows_drawn_by_task_seed_not_the_tail(tmp_path: Path) -> None:
    # A sorted file: its tail would be its 8 largest rows.
    path = make_jsonl(tmp_path / "train.jsonl", 40)

    def split(seed: int) -> tuple[list[str], list[str]]:
        task = build_task(TaskConfig(name="jsonl", train_path=str(path), num_eval=8, seed=seed, rewards=["exact_match"]))
        return [example.prompt for example in task.train], [example.prompt for example in task.eval]

    train, held_out = split(seed=0)
    assert len(held_out) == 8 and len(train) == 32
    assert held_out != [f"p{i}" for i in range(32, 40)]
    assert sorted(train + held_out) == sorted(f"p{i}" for i in range(40))
    # Both keep the file's order; the training order is the scheduler's to shuffle.
    file_order = [f"p{i}" for i in range(40)]
    assert train == [p for p in file_order if p in train] and held_out == [p for p in file_order if p in held_out]
    assert split(seed=0) == (train, held_out)
    assert split(seed=1)[1] != held_out


def test_build_jsonl_task_holds_out_at_most_half(tmp_path: Path) -> None:
    path = make_jsonl(tmp_path / "train.jsonl", 7)
    task = build_task(TaskConfig(name="jsonl", train_path=str(path), num_eval=100))
    assert (len(task.train), len(task.eval)) == (4, 3)


def test_build_jsonl_task_single_example_without_eval_path_fails(tmp_path: Path) -> None:
    path = make_jsonl(tmp_path / "one.jsonl", 1)
    with pytest.raises(ValueError, match="eval_path"):
        build_task(TaskConfig(name="jsonl", train_path=str(path)))


def test_build_jsonl_task_empty_train_fails(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no examples"):
        build_task(TaskConfig(name="jsonl", train_path=str(path)))


def test_build_jsonl_task_with_eval_path_caps_eval(tmp_path: Path) -> None:
    train = make_jsonl(tmp_path / "train.jsonl", 6)
    eval_file = make_jsonl(tmp_path / "eval.jsonl", 10)
    task = build_task(TaskConfig(name="jsonl", train_path=str(train), eval_path=str(eval_file), num_eval=4))
    assert len(task.train) == 6
    assert [example.prompt for example in task.eval] == ["p0", "p1", "p2", "p3"]


def test_bundled_gsm8k_mini_builds_and_scores() -> None:
    task = build_task(
        TaskConfig(
            name="jsonl",
            train_path="builtin:gsm8k_mini",
            eval_path="builtin:gsm8k_mini_eval.jsonl",
            rewards=["r1_format", "r1_accuracy"],
            reward_weights=[0.5, 1.0],
        )
    )
    assert len(task.train) >= 20 and len(task.eval) >= 6
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.eval}
    for example in task.train + task.eval:
        final = example.answer.rsplit("####", 1)[1].strip()
        perfect = f"<think>reasoning</think>\n<answer>{final}</answer>"
        assert task.score(perfect, example) == pytest.approx(1.5)


def test_data_path_and_resolution() -> None:
    path = data_path("gsm8k_mini.jsonl")
    assert path.is_file() and path == data_path("gsm8k_mini")
    assert resolve_task_path("builtin:gsm8k_mini") == path
    assert resolve_task_path("some/file.jsonl") == Path("some/file.jsonl")
    with pytest.raises(FileNotFoundError, match="gsm8k_mini.jsonl"):
        data_path("nope")
