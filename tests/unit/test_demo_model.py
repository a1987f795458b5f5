"""`grpo-fleet demo --model NAME`: a zoo model's packaged demo, its paths taken from its own folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import DemoOptions, demo_run_dir, demo_settings, packaged_demo
from grpo_fleet.models.zoo import ZooError


def test_the_packaged_demo_runs_the_zoo_model_on_files_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # anywhere but the checkout: the demo must not depend on the cwd
    # demo_config adds ports and the run dir to these settings (it binds sockets to find free ports: not here).
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct")))
    folder = packaged_demo("smollm2-135m-instruct").parent
    assert cfg.model.path == "zoo:smollm2-135m-instruct"
    assert cfg.task.train_path == str(folder / "capitals_train.jsonl") and Path(cfg.task.train_path).is_file()
    assert cfg.task.eval_path == str(folder / "capitals_eval.jsonl") and Path(cfg.task.eval_path).is_file()
    assert cfg.task.reward_module == str(folder / "capitals_rewards.py") and Path(cfg.task.reward_module).is_file()
    assert cfg.lora.enabled and cfg.task.chat_template


def test_a_config_of_yours_replaces_the_packaged_task_but_keeps_the_model(tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text('[task]\nname = "reverse"\n[train]\nsteps = 5\n')
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="smollm2-135m-instruct", config=str(mine))))
    assert cfg.task.name == "reverse" and cfg.model.path == "zoo:smollm2-135m-instruct"


def test_an_unknown_model_is_refused_by_name() -> None:
    with pytest.raises(ZooError, match="unknown model 'llama-9000'"):
        demo_settings(DemoOptions(model="llama-9000"))


def test_each_demo_writes_to_its_own_run_dir_unless_told(tmp_path: Path) -> None:
    # The capital-quiz demo once ran in runs/demo-real and deleted the demo-real run's metrics on start.
    def run_dir(**options: str) -> str:
        chosen = DemoOptions(**options)  # type: ignore[arg-type]
        return demo_run_dir(chosen, demo_settings(chosen))

    assert run_dir(model="smollm2-135m-instruct") == "runs/demo-real"
    assert run_dir(model="smollm2-135m-instruct", config="capital-quiz") == "runs/demo-quiz"
    assert run_dir(model="smollm2-135m-instruct", config="capital-quiz", run_dir="elsewhere") == "elsewhere"
    mine = tmp_path / "mine.toml"
    mine.write_text('[train]\nsteps = 5\n')  # names no run_dir: the demo's default, not the config model's
    assert run_dir(model="smollm2-135m-instruct", config=str(mine)) == "runs/demo-real"
    assert run_dir(config=str(mine)) == "runs/demo"
    mine.write_text('run_dir = "runs/mine"\n')
    assert run_dir(config=str(mine)) == "runs/mine"
