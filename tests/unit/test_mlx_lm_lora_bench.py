"""The mlx-lm-lora baseline's pure parts: the like-for-like mapping, its job, its progress log, its venv's cache.

Running it (a venv, a subprocess, a model) is the bench's job, not a unit test's.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import fields, replace
from pathlib import Path

import mlx.nn as nn
import pytest

from grpo_fleet.bench import baseline_venv
from grpo_fleet.bench.baseline_venv import BaselineUnavailable, ensure_venv, mlx_lm_lora_requirements, venv_path
from grpo_fleet.bench.mlx_lm_lora import (
    BASELINE_ONLY,
    CONFIG_FIELDS,
    LikeForLike,
    apply_spec,
    completions_per_second,
    parse_progress,
    runner_job,
    spec_from_config,
    step_seconds,
)
from grpo_fleet.bench.mlx_lm_lora_runner import Clock, ProgressLog, reward_adapter
from grpo_fleet.config import RunConfig

SPEC = LikeForLike(model_dir="/models/m", train_path="/data/train.jsonl", eval_path="/data/eval.jsonl",
                   rewards=("first_integer", "exact_match"), reward_module="/data/rewards.py", reward_weights=(1.0, 0.5),
                   chat_template=True, system_prompt="Be brief.", num_eval=32, steps=30, prompts_per_step=6,
                   group_size=5, max_tokens=40, temperature=0.9, lr=3e-5, lora_rank=4, lora_scale=16.0,
                   lora_layers=12, lora_keys=("self_attn.q_proj", "self_attn.v_proj"), beta=0.02, epsilon=0.25,
                   loss_type="dapo", eval_every=10, seed=7)


def _job(spec: LikeForLike, tmp: Path) -> dict:
    cfg = apply_spec(spec)
    return runner_job(spec, cfg, train_rows=tmp / "rows.jsonl", out_dir=tmp, launched=100.0, grpo_src="/src",
                      reward_module=spec.reward_module, reward_weights=list(spec.reward_weights or (1.0,)))


def test_every_shared_setting_has_one_grpo_fleet_field():
    names = {f.name for f in fields(LikeForLike)}
    assert names == set(CONFIG_FIELDS) | set(BASELINE_ONLY)
    assert len(set(CONFIG_FIELDS.values())) == len(CONFIG_FIELDS)


def test_apply_spec_writes_every_field_and_reads_back_the_same_spec():
    cfg = apply_spec(SPEC)
    assert (cfg.grpo.groups_per_step, cfg.generation.group_size, cfg.generation.max_tokens) == (6, 5, 40)
    assert (cfg.optim.lr, cfg.lora.rank, cfg.lora.scale, cfg.lora.num_layers) == (3e-5, 4, 16.0, 12)
    assert cfg.lora.enabled and cfg.task.name == "jsonl" and cfg.task.rewards == ["first_integer", "exact_match"]
    assert cfg.grpo.clip_range == (0.25, 0.25) and cfg.train.eval_every == 10 and cfg.train.seed == 7
    assert spec_from_config(cfg) == SPEC
    assert spec_from_config(cfg, their_sampler=False) == replace(SPEC, their_sampler=False)


def test_apply_spec_keeps_the_base_configs_other_settings():
    base = RunConfig.model_validate({"optim": {"grad_clip": 0.5}, "train": {"checkpoint_every": 3}})
    cfg = apply_spec(SPEC, base)
    assert cfg.optim.grad_clip == 0.5 and cfg.train.checkpoint_every == 3 and cfg.optim.lr == 3e-5


def test_a_loss_mlx_lm_lora_lacks_and_a_non_jsonl_task_are_refused():
    with pytest.raises(ValueError, match="mlx-lm-lora has"):
        apply_spec(replace(SPEC, loss_type="gspo"))
    with pytest.raises(ValueError, match="JSONL task"):
        spec_from_config(RunConfig())


def test_runner_job_speaks_mlx_lm_lora_with_the_same_numbers(tmp_path):
    job = _job(SPEC, tmp_path)
    trainer = job["trainer"]
    assert (trainer["batch_size"], trainer["group_size"], trainer["iters"], trainer["max_completion_length"]) == (6, 5, 30, 40)
    assert (trainer["temperature"], trainer["beta"], trainer["epsilon"], trainer["epsilon_high"]) == (0.9, 0.02, 0.25, 0.25)
    assert trainer["grpo_loss_type"] == "bnpo"  # grpo-fleet's token-mean "dapo"
    assert (trainer["top_p"], trainer["top_k"]) == (0.95, 20)
    assert trainer["steps_per_report"] == 1 and trainer["steps_per_save"] > 30 and trainer["steps_per_eval"] > 30
    assert job["lora"] == {"num_layers": 12, "parameters": {"rank": 4, "scale": 16.0, "dropout": 0.0,
                                                            "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}
    assert (job["lr"], job["seed"], job["eval_every"], job["end_answer_token"]) == (3e-5, 7, 10, "")
    assert job["rewards"]["names"] == ["first_integer", "exact_match"] and job["rewards"]["weights"] == [1.0, 0.5]
    json.dumps(job)  # it travels as JSON


def test_matched_sampler_turns_top_p_and_top_k_off(tmp_path):
    trainer = _job(replace(SPEC, their_sampler=False, loss_type="grpo"), tmp_path)["trainer"]
    assert (trainer["top_p"], trainer["top_k"], trainer["grpo_loss_type"]) == (1.0, 0, "grpo")


def test_progress_parsing_keeps_snapshots_in_step_order_and_times_every_step():
    lines = [json.dumps({"step": s, "wall_seconds": 2.0 + 1.5 * s, "completions": 16 * s,
                         "adapter": f"a{s}" if s % 2 == 0 else None}) for s in (4, 0, 1, 2, 3)]
    snapshots = parse_progress(["", *lines])
    assert [(s.step, s.completions, s.adapter) for s in snapshots] == [(0, 0, "a0"), (2, 32, "a2"), (4, 64, "a4")]
    ordered = sorted(lines, key=lambda line: json.loads(line)["step"])
    assert step_seconds(ordered) == pytest.approx([1.5] * 4)
    assert completions_per_second(lines) == pytest.approx(64 / 6.0)  # from step 0's clock, not the launch
    assert math.isnan(completions_per_second(lines[1:2]))  # step 0 alone


def test_runner_log_snapshots_only_at_eval_steps_and_the_end(tmp_path):
    job = _job(replace(SPEC, steps=5, eval_every=2), tmp_path)
    clock = Clock(launched=0.0)
    log = ProgressLog(nn.Linear(2, 2), job, clock)
    for step in range(6):
        log.record(step, {"train_total_rewards_mean": 0.5} if step else None)
    log.handle.close()
    records = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["adapter"]] == [0, 2, 4, 5]
    assert all(Path(r["adapter"]).is_file() for r in records if r["adapter"])
    assert records[3]["completions"] == 3 * 6 * 5 and records[3]["train_reward"] == 0.5
    assert clock.paused > 0


def test_reward_adapter_scores_with_grpo_fleets_rewards_by_row(tmp_path):
    module = tmp_path / "rewards.py"
    module.write_text("from grpo_fleet.tasks import register_reward\n\n"
                      "@register_reward\ndef lorabase_says_none(completion, prompt, *, answer, **columns):\n"
                      "    return None\n")
    rows = [{"prompt": "1+1?", "columns": {"answer": "2"}}, {"prompt": "2+2?", "columns": {"answer": "4"}}]
    job = _job(replace(SPEC, steps=2, eval_every=1), tmp_path)
    job["rewards"].update(names=["exact_match"], weights=[2.0], module=None)
    log = ProgressLog(nn.Linear(2, 2), job, Clock(0.0))
    reward = reward_adapter(rows, job, log)
    assert reward(prompts=["", "", ""], completions=["2", "4", "2"], answer=["", "", ""], types=[0, 1, 1]) == [2.0, 2.0, 0.0]
    job["rewards"].update(names=["lorabase_says_none"], weights=[1.0], module=str(module))
    unscorable = reward_adapter(rows, job, log)
    assert unscorable(prompts=[""], completions=["2"], answer=[""], types=[0]) == [0.0] and log.unscored == 1
    log.handle.close()


def test_requirements_pin_mlx_lm_lora_and_the_right_mlx_wheel():
    linux, mac = mlx_lm_lora_requirements("linux"), mlx_lm_lora_requirements("darwin")
    assert linux[0] == f"mlx-lm-lora=={baseline_venv.MLX_LM_LORA_VERSION}" and mac[0] == linux[0]
    assert any(r.startswith("mlx[cpu]==") for r in linux) and any(r.startswith("mlx==") for r in mac)
    assert venv_path("x", linux, Path("/c")) != venv_path("x", mac, Path("/c"))
    assert venv_path("x", linux, Path("/c")) == venv_path("x", list(reversed(linux)), Path("/c"))


def test_a_ready_venv_is_reused_without_installing(tmp_path, monkeypatch):
    monkeypatch.setattr(baseline_venv, "_run", lambda command: pytest.fail(f"ran {command}"))
    path = venv_path("m", ["pkg==1"], tmp_path)
    path.mkdir(parents=True)
    (path / baseline_venv.READY).write_text("pkg==1\n")
    assert ensure_venv("m", ["pkg==1"], tmp_path) == path / "bin" / "python"


def test_an_unreachable_index_makes_the_baseline_unavailable_and_leaves_no_half_venv(tmp_path, monkeypatch):
    def no_index(command: list[str]) -> None:
        Path(command[-1] if command[1:3] == ["-m", "venv"] else tmp_path).mkdir(parents=True, exist_ok=True)
        if "pip" in command:
            raise subprocess.CalledProcessError(1, command, output=b"ERROR: No matching distribution found for pkg==1")

    monkeypatch.setattr(baseline_venv, "_run", no_index)
    with pytest.raises(BaselineUnavailable, match="No matching distribution"):
        ensure_venv("m", ["pkg==1"], tmp_path)
    assert not venv_path("m", ["pkg==1"], tmp_path).exists()
