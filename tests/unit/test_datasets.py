"""Task 'dataset': Hugging Face datasets from the hub (through a loader seam) or made locally with `datasets`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset, DatasetDict
from pydantic import ValidationError

from grpo_fleet.config import TaskConfig
from grpo_fleet.tasks import build_task
from grpo_fleet.tasks.hf_datasets import is_saved_to_disk, load_split, local_path

GSM8K_ROWS = {
    "question": [f"Tom has {n} apples and buys {n} more. How many now?" for n in range(10)],
    "answer": [f"{n} + {n} = {2 * n}\n#### {2 * n * 1000:,}" for n in range(10)],
    "level": list(range(10)),
}


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow caches of local files go under tmp_path, and nothing may reach the hub."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def dataset_task(source: Path | str, **fields: Any):
    return build_task(TaskConfig(name="dataset", dataset=str(source), rewards=["r1_accuracy"], **fields))


@pytest.mark.parametrize("form", ["save_to_disk", "parquet", "jsonl"])
def test_local_gsm8k_in_every_form_reads_the_same(tmp_path: Path, form: str) -> None:
    rows = Dataset.from_dict(GSM8K_ROWS)
    target = {"save_to_disk": tmp_path / "saved", "parquet": tmp_path / "gsm8k.parquet", "jsonl": tmp_path / "gsm8k.jsonl"}[form]
    {"save_to_disk": rows.save_to_disk, "parquet": rows.to_parquet, "jsonl": rows.to_json}[form](str(target))

    task = dataset_task(target, num_eval=3)

    assert len(task.train) == 7 and len(task.eval) == 3
    row = {example.columns["level"]: example for example in task.train + task.eval}  # the held-out rows are drawn
    assert sorted(row) == list(range(10))
    assert row[0].prompt == GSM8K_ROWS["question"][0]  # 'question' is found without prompt_column
    assert row[4].answer == "8000"  # "#### 8,000": the part after ####, commas dropped
    assert row[0].columns == {"answer": GSM8K_ROWS["answer"][0], "level": 0}  # all but the prompt, as loaded
    assert row[9].answer == "18000"
    # Every column reaches the rewards; `answer` is the reference answer as read.
    assert task.fields(row[4]) == {"answer": "8000", "level": 4}
    assert task.score("<think>4+4</think><answer>8 000</answer>", row[4]) == 1.0


def test_dataset_dict_on_disk_gives_train_and_eval_splits(tmp_path: Path) -> None:
    DatasetDict({
        "train": Dataset.from_dict({"prompt": ["a?", "b?", "c?"], "answer": [1, 2, 3]}),
        "test": Dataset.from_dict({"prompt": ["d?", "e?"], "answer": [4.5, 5]}),
    }).save_to_disk(str(tmp_path / "dd"))

    task = dataset_task(tmp_path / "dd", eval_split="test", num_eval=1)

    assert [ex.prompt for ex in task.train] == ["a?", "b?", "c?"]
    assert [(ex.prompt, ex.answer) for ex in task.eval] == [("d?", "4.5")]  # first num_eval of eval_split
    with pytest.raises(ValueError, match=r"no split 'validation'; its splits are train, test"):
        dataset_task(tmp_path / "dd", eval_split="validation")


def test_directory_of_split_files_is_read_by_split_name(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    Dataset.from_dict({"prompt": ["a?", "b?"], "answer": ["1", "2"]}).to_json(str(tmp_path / "data" / "train.jsonl"))
    Dataset.from_dict({"prompt": ["c?"], "answer": ["3"]}).to_json(str(tmp_path / "data" / "test.jsonl"))

    task = dataset_task(tmp_path / "data", eval_split="test")

    assert [ex.prompt for ex in task.train] == ["a?", "b?"] and [ex.prompt for ex in task.eval] == ["c?"]


def test_chat_format_prompts_and_mapped_columns(tmp_path: Path) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    Dataset.from_dict({
        "messages": [conversation, [{"role": "user", "content": "3+3?"}]],
        "solution": ["4", "6"],
        "source": ["x", "y"],
    }).save_to_disk(str(tmp_path / "chat"))

    task = dataset_task(tmp_path / "chat", prompt_column="messages", answer_column="solution", num_eval=1)

    assert len(task.train) == len(task.eval) == 1
    row = {example.columns["source"]: example for example in task.train + task.eval}  # the held-out row is drawn
    assert row["x"].prompt == tuple(conversation)
    assert row["x"].answer == "4"
    assert row["x"].columns == {"solution": "4", "source": "x"}
    assert row["y"].prompt == ({"role": "user", "content": "3+3?"},)


def test_hub_id_is_loaded_with_its_config_and_split() -> None:
    calls: list[tuple[tuple, dict]] = []

    def fake_load_dataset(*args: Any, **kwargs: Any) -> Dataset:
        calls.append((args, kwargs))
        return Dataset.from_dict({"question": ["q?"], "answer": ["#### 1"]})

    rows = load_split("openai/gsm8k", "test", config="main", load_dataset=fake_load_dataset, load_from_disk=None)

    assert calls == [(("openai/gsm8k",), {"name": "main", "split": "test"})]
    assert rows.column_names == ["question", "answer"]
    assert local_path("openai/gsm8k") is None


def test_missing_column_names_the_columns_there_are(tmp_path: Path) -> None:
    Dataset.from_dict({"text": ["a", "b"], "label": ["1", "2"]}).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(ValueError, match=r"no 'prompt' or 'question' column; its columns are text, label"):
        dataset_task(tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"no column 'answer' \(task.answer_column\); its columns are text, label"):
        dataset_task(tmp_path / "d.parquet", prompt_column="text")
    with pytest.raises(ValueError, match=r"no column 'body' \(task.prompt_column\)"):
        dataset_task(tmp_path / "d.parquet", prompt_column="body", answer_column="label")


def test_empty_split_is_refused(tmp_path: Path) -> None:
    empty = Dataset.from_dict({"prompt": ["c?"], "answer": ["3"]}).select([])
    with pytest.raises(ValueError, match=r"someone/data split 'test' has no rows"):
        load_split("someone/data", "test", load_dataset=lambda *a, **k: empty, load_from_disk=None)
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    # `datasets` itself refuses an empty file; the error names the file and split.
    with pytest.raises(ValueError, match=r"empty.parquet split 'train': .*no data"):
        dataset_task(tmp_path / "empty.parquet")


@pytest.mark.parametrize(
    ("prompts", "answers", "problem"),
    [
        (["a?", "  "], ["1", "2"], r"row 1: column 'prompt' is empty"),
        (["a?", "b?"], ["1", "#### "], r"row 1: column 'answer' is empty"),
        (["a?", "b?"], [True, False], r"row 0: column 'answer' must be text or a number, got bool True"),
        ([[{"role": "user"}], [{"role": "user"}]], ["1", "2"], r"row 0: column 'prompt' must be text or a non-empty list"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, prompts: list, answers: list, problem: str) -> None:
    Dataset.from_dict({"prompt": prompts, "answer": answers}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=problem):
        dataset_task(tmp_path / "bad", num_eval=1)


def test_single_file_has_only_a_train_split(tmp_path: Path) -> None:
    Dataset.from_dict({"prompt": ["a?", "b?"], "answer": ["1", "2"]}).to_json(str(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match=r"only split is 'train', not 'test'"):
        dataset_task(tmp_path / "d.jsonl", eval_split="test")


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        dataset_task(tmp_path / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="no such file"):
        local_path("./data/missing")


def test_bundled_jsonl_reads_as_a_dataset_too() -> None:
    task = dataset_task("builtin:gsm8k_mini", eval_split=None, num_eval=4)
    assert len(task.eval) == 4 and all(ex.answer and "####" not in ex.answer for ex in task.train)


def test_without_eval_split_rows_drawn_by_task_seed_are_held_out(tmp_path: Path) -> None:
    Dataset.from_dict(GSM8K_ROWS).to_json(str(tmp_path / "d.jsonl"))
    task = dataset_task(tmp_path / "d.jsonl", num_eval=3, seed=0)
    held_out = [example.columns["level"] for example in task.eval]
    assert len(held_out) == 3 and held_out != [7, 8, 9]  # not the file's tail
    assert sorted(held_out + [example.columns["level"] for example in task.train]) == list(range(10))
    assert [ex.columns["level"] for ex in dataset_task(tmp_path / "d.jsonl", num_eval=3, seed=0).eval] == held_out


def test_is_saved_to_disk(tmp_path: Path) -> None:
    Dataset.from_dict({"a": [1]}).save_to_disk(str(tmp_path / "one"))
    assert is_saved_to_disk(tmp_path / "one") and not is_saved_to_disk(tmp_path)


def test_task_config_ties_dataset_to_the_dataset_task() -> None:
    with pytest.raises(ValidationError, match="needs task.dataset"):
        TaskConfig(name="dataset")
    with pytest.raises(ValidationError, match="set task.name = 'dataset'"):
        TaskConfig(name="reverse", dataset="openai/gsm8k")
    cfg = TaskConfig(name="dataset", dataset="openai/gsm8k", dataset_config="main", eval_split="test")
    assert (cfg.split, cfg.prompt_column, cfg.answer_column) == ("train", None, "answer")
