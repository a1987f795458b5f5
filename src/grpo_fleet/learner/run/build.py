"""Build a learner from a RunConfig: model, task, tokenized prompts, trainer."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from grpo_fleet.config import RunConfig, load_run_config
from grpo_fleet.envs.process import EnvProcess
from grpo_fleet.learner.records.runlog import LogSizes
from grpo_fleet.learner.records.trackers import build_trackers, require_installed
from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.learner.step import vector_exp
from grpo_fleet.learner.step.memory import check_step_fits, estimate_step_memory, machine_memory_bytes
from grpo_fleet.learner.step.objective import Loss
from grpo_fleet.learner.step.trainer import load_trainer
from grpo_fleet.learner.verify.env_replay import EnvCalling
from grpo_fleet.models.loading import Policy, latest_checkpoint, model_digest
from grpo_fleet.models.realshape import build_realshape, is_realshape
from grpo_fleet.models.tiny_model import build_tiny_model
from grpo_fleet.models.zoo import import_source, is_gguf_source
from grpo_fleet.observe.metrics import learner_metrics
from grpo_fleet.runtime.durable import write_atomic
from grpo_fleet.tasks import Task, build_task
from grpo_fleet.tasks.env_module import EnvSetup
from grpo_fleet.tasks.prompts import check_prompt_lengths, context_length, encode_prompt
from grpo_fleet.tasks.reward_runner import RewardSet, Scorer, ScoringProcess

log = logging.getLogger("grpo_fleet.learner")


class RunDirInUse(RuntimeError):
    """A fresh run was pointed at a directory that already holds one."""


def tokenizer_corpus(task: Task) -> list[str]:
    """Text the tiny model's tokenizer is trained on: the task's prompts and answers."""
    lines = [f"{ex.prompt}{ex.answer}" for ex in task.train + task.eval]
    if any(name.startswith("r1_") for name in task.reward_names):
        # The R1 rewards ask for tags the dataset text itself never contains.
        lines.append("<think> </think> <answer> </answer>")
    return lines


def resolve_model_path(cfg: RunConfig, task: Task) -> str:
    """The model directory or hub id to load; builds the tiny or a real-shape model, or imports a GGUF, when asked."""
    if is_realshape(cfg.model.path):
        return str(build_realshape(cfg.model.path, cfg.model.cache_dir).resolve())
    if is_gguf_source(cfg.model.path):
        return str(import_source(cfg.model.path, cfg.model.cache_dir or Path(cfg.run_dir) / "models").resolve())
    if cfg.model.path != "tiny":
        return cfg.model.path
    target = Path(cfg.run_dir) / "tiny-model"
    build_tiny_model(target, cfg.model.tiny, tokenizer_corpus(task))
    return str(target.resolve())


def tokenize_prompts(tokenizer: object, task: Task, cfg: RunConfig, *, split: str = "train") -> list[np.ndarray]:
    """Token ids of every prompt, chat template applied when configured."""
    examples = task.train if split == "train" else task.eval
    return [
        np.asarray(
            encode_prompt(tokenizer, ex.prompt, chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt),
            dtype=np.int32,
        )
        for ex in examples
    ]


def _log_loss(cfg: RunConfig, loss: Loss) -> None:
    """Say, once, which loss trains and how the step's logprob check gets the logprobs it compares (every loss is
    checked: docs/learner-step.md, Choosing the loss)."""
    if not cfg.security.verify_logprobs:
        log.info("loss %s (grpo.loss); the logprob check is off (security.verify_logprobs)", loss.name)
        return
    log.info("loss %s (grpo.loss); the step's logprob check compares against %s", loss.name, loss.check_cost())


def _log_exp(cfg: RunConfig) -> None:
    """Say which exp the step takes on the CPU backend: the native kernel's, or MLX's (scalar on x86) and why."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    if not cfg.train.native_exp:
        log.info("exp: MLX's (train.native_exp is off)")
    elif vector_exp.native_active():
        log.info("exp: the native kernel's (%s)", vector_exp.NATIVE_KERNEL)
    else:
        log.warning("exp: MLX's, scalar on x86: the native kernel is %s", vector_exp.NATIVE_KERNEL)


def _check_memory(cfg: RunConfig, policy: Policy, reference_copy: bool) -> None:
    """Say what a step will need, and refuse one that this machine cannot hold (before pi_ref is loaded too)."""
    estimate = estimate_step_memory(policy.model, cfg, reference_copy=reference_copy)
    available = machine_memory_bytes()
    log.info("one learner step needs about %s; this machine has %.1f GiB", estimate.describe(), available / (1 << 30))
    if cfg.train.memory_check:
        check_step_fits(estimate, available)


def _open_trackers(learner: RunCoordinator, cfg: RunConfig, run_dir: Path) -> None:
    """logging.report_to's trackers, opened at the step the run continues from; a failure closes the run's files."""
    try:
        learner.trackers.adopt(build_trackers(cfg, run_dir, learner.metrics.tracker_errors,
                                              run_id=learner.state.run_id, first_step=learner.state.step + 1))
    except BaseException:
        learner.close()
        raise


def build_learner(cfg: RunConfig, *, resume: bool = False, pub_address: Optional[str] = None,
                  make_scorer: Callable[[RewardSet], Scorer] = ScoringProcess,
                  make_envs: Callable[[EnvSetup], EnvCalling] = EnvProcess) -> RunCoordinator:
    """Everything the learner needs, loaded and ready; writes the resolved config to the run dir.

    With `resume`, continues from the run directory's latest checkpoint.
    `make_scorer` builds what re-scores submissions (security.verify_rewards): a
    process of its own, which can interrupt a reward that hangs, unless the
    caller gives another (the unit tests run rewards in-process: they may start
    no process); `make_envs` likewise hosts the replay of a deterministic
    environment (learner/verify/env_replay.py).
    """
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger = run_dir / "ledger.jsonl"
    if not resume and ledger.exists() and ledger.stat().st_size > 0:
        raise RunDirInUse(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick a new run_dir")
    require_installed(cfg.logging)  # before a model load that may take minutes
    task = build_task(cfg.task)
    path = resolve_model_path(cfg, task)
    trainer = load_trainer(cfg, path, before_reference=partial(_check_memory, cfg))
    _log_loss(cfg, trainer.loss)
    _log_exp(cfg)
    policy = trainer.policy
    prompts = tokenize_prompts(policy.tokenizer, task, cfg)
    eval_prompts = tokenize_prompts(policy.tokenizer, task, cfg, split="eval")
    for split, tokens in (("train", prompts), ("eval", eval_prompts)):
        check_prompt_lengths(tokens, max_new_tokens=cfg.generation.max_tokens, context=context_length(policy.model),
                             split=split)
    write_run_config(run_dir, cfg)
    learner = RunCoordinator(
        cfg, policy, trainer, task, prompts, model_digest(path), learner_metrics(), run_dir, pub_address=pub_address,
        eval_prompt_tokens=eval_prompts, make_scorer=make_scorer, make_envs=make_envs,
    )
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        learner.resume(checkpoint)
    elif resume:
        # The run died before its first checkpoint: start over, logs included.
        learner.runlog.truncate(LogSizes())
    _open_trackers(learner, cfg, run_dir)
    log.info("learner ready: model %s, %d prompts, run %s", path, len(prompts), learner.state.run_id)
    return learner


def write_run_config(run_dir: Path, cfg: RunConfig) -> None:
    """RUN_DIR/config.json, replaced atomically: a crash or a full disk mid-write leaves the previous one, which
    the next `--resume` reads (a plain write truncates it first)."""
    write_atomic(run_dir / "config.json", json.dumps(cfg.model_dump(mode="json"), indent=2).encode())


def load_resume_config(run_dir: str, overrides: Optional[list[str]] = None) -> RunConfig:
    """The config a run was started with (RUN_DIR/config.json), plus overrides."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a grpo-fleet run directory?")
    return load_run_config(path, overrides or [])
