"""`grpo-fleet demo`: a learner and N actors on this machine learn to reverse digits.

Real processes talking ZeroMQ over 127.0.0.1, the tiny self-built model loaded
through mlx_lm, held-out reward measured before, during and after training by
the learner's own eval rounds (train.eval_every: eval leases the actors take).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from grpo_fleet.config import RunConfig, apply_overrides, load_run_config, toml_string
from grpo_fleet.export.hint import export_hint
from grpo_fleet.launch.local_fleet import Fleet, FleetStop, early_stop, running
from grpo_fleet.models.zoo import ZOO_PREFIX, ZooError, is_gguf_source, lookup, model_reference
from grpo_fleet.observe.plotting import load_eval_records
from grpo_fleet.protocol.endpoints import free_port, loopback_endpoint
from grpo_fleet.runtime.run_lock import RunDirLock

# The demo's defaults: small enough for 2 CPU cores, tuned so learning is visible
# within a few minutes (lr >= 5e-4 collapsed the tiny model; beta 0.04 keeps groups informative).
DEMO_SETTINGS: dict = {
    "model": {"path": "tiny"},
    "generation": {"group_size": 8, "max_tokens": 5, "temperature": 1.0},
    "task": {"name": "reverse", "digits": 3, "num_train": 800, "num_eval": 128},
    "grpo": {"beta": 0.04, "groups_per_step": 8, "max_staleness": 2},
    "optim": {"lr": 1e-4},
    "train": {"steps": 1500, "checkpoint_every": 250, "eval_every": 250},
    "server": {"max_groups_per_lease": 4, "lease_seconds": 30.0},
}


@dataclass
class DemoOptions:
    actors: int = 2
    steps: Optional[int] = None
    run_dir: Optional[str] = None  # default: the config's own run_dir, else runs/demo (runs/demo-real with a model)
    progress: bool = True
    config: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    model: Optional[str] = None  # a zoo model: its packaged demo (task, data, rewards) unless `config` is given


DEMOS_DIR = Path(__file__).parents[1] / "demos"


def packaged_demo(model: str, variant: str = "demo") -> Path:
    """A demo config shipped for a zoo model (grpo_fleet/demos/NAME/VARIANT.toml; demo.toml by default)."""
    name = lookup(model).name
    path = DEMOS_DIR / name / f"{variant}.toml"
    if not path.exists():
        raise ZooError(f"no packaged demo for {name!r}; pass --config with a task of yours")
    return path


def _anchored(data: dict, base: Path) -> dict:
    """A packaged demo's relative data and reward paths, taken from its own folder rather than the cwd."""
    task = dict(data.get("task", {}))
    for key in ("train_path", "eval_path", "reward_module"):
        value = task.get(key)
        if isinstance(value, str) and not value.startswith("builtin:") and not Path(value).is_absolute():
            task[key] = str((base / value).resolve())
    return {**data, "task": task}


def demo_config(options: DemoOptions) -> RunConfig:
    """Demo defaults, then the user's config file, then --set overrides and flags."""
    data = demo_settings(options)
    flags = [f"run_dir={toml_string(str(Path(demo_run_dir(options, data)).resolve()))}",
             f"server.bind={toml_string(loopback_endpoint())}", f"server.pub_bind={toml_string(loopback_endpoint())}",
             f"metrics.port={free_port()}"]
    if options.steps is not None:
        flags.append(f"train.steps={options.steps}")
    cfg = RunConfig.model_validate(apply_overrides(data, options.overrides + flags))
    if cfg.train.eval_every == 0:  # the demo's before and after are the learner's first and last eval rounds
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_every": cfg.train.steps})})
    return cfg


def demo_run_dir(options: DemoOptions, settings: dict) -> str:
    """--run-dir, else the run_dir the config file names (so the capital-quiz demo does not write over the
    demo-real run), else the demo's default."""
    default = "runs/demo-real" if options.model is not None else "runs/demo"
    return options.run_dir or settings.get("run_dir") or default


def _file_settings(path: str | Path) -> dict:
    """A config file's settings, run_dir only when the file names one (the model's default is not a choice)."""
    cfg = load_run_config(path, [])
    data = cfg.model_dump(mode="json")
    if "run_dir" not in cfg.model_fields_set:
        del data["run_dir"]
    return data


def demo_settings(options: DemoOptions) -> dict:
    """The settings the overrides apply to: the user's config, a zoo model's packaged demo, or the tiny demo."""
    variant = _packaged_variant(options)
    if options.config is not None and variant is None:
        data = _file_settings(options.config)
    elif options.model is not None:
        demo = packaged_demo(options.model, variant or "demo")
        data = _anchored(_file_settings(demo), demo.parent)
    else:
        return DEMO_SETTINGS
    if options.model is not None:
        data["model"] = {**data.get("model", {}), "path": f"{ZOO_PREFIX}{lookup(options.model).name}"}
    return data


def _packaged_variant(options: DemoOptions) -> Optional[str]:
    """--config NAME with --model: another demo shipped for that model (e.g. capital-quiz), when no such file is here."""
    config = options.config
    if options.model is None or config is None or Path(config).exists() or "/" in config or config.endswith(".toml"):
        return None
    return config


def follow(fleet: Fleet, cfg: RunConfig, progress: bool) -> tuple[list[dict], Optional[FleetStop]]:
    """Wait for the learner to finish, showing a progress bar fed by metrics.jsonl; the step records,
    and why the fleet stopped early if a child's exit ended the run (see launch/local_fleet.py: early_stop)."""
    from tqdm import tqdm

    from grpo_fleet.observe.plotting import load_step_records

    path = Path(cfg.run_dir) / "metrics.jsonl"

    def finished() -> bool:
        records = load_step_records(path)
        return bool(records) and records[-1]["step"] >= cfg.train.steps

    bar = tqdm(total=cfg.train.steps, desc="training", unit="step", disable=not progress, file=sys.stdout)
    seen = 0
    while True:
        seen = _show_progress(bar, load_step_records(path), seen)
        failure = early_stop(fleet, finished)
        if failure is not None or fleet.learner.proc.poll() is not None:
            break
        time.sleep(0.5)
    bar.close()
    return load_step_records(path), failure or early_stop(fleet, finished)


def _show_progress(bar: Any, records: list[dict], seen: int) -> int:
    """Advance the bar to `records`; returns how many it has shown."""
    if len(records) > seen:
        bar.update(len(records) - seen)
        last = records[-1]
        bar.set_postfix(reward=f"{last['reward_mean']:.3f}", kl=f"{last['kl']:.4f}", v=last["policy_version"])
    return max(seen, len(records))


def held_out_reward(model_or_checkpoint: str, cfg: RunConfig) -> float:
    """Greedy held-out reward of a model directory or a checkpoint."""
    from grpo_fleet.models.evaluate import evaluate
    from grpo_fleet.models.loading import default_dtype, load_checkpoint
    from grpo_fleet.models.quant import cast_floating
    from grpo_fleet.tasks import build_task

    model, tokenizer = load_checkpoint(model_or_checkpoint)
    dtype = default_dtype()
    if dtype:
        cast_floating(model, dtype)
    return evaluate(model, tokenizer, build_task(cfg.task), cfg)


def local_model_path(path: str) -> str:
    """A model directory as an absolute path, so learner, actors and checkpoints agree on it whatever
    the working directory; a hub id unchanged."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.is_dir() else path


def prepare(options: DemoOptions) -> tuple[RunConfig, Path]:
    """The demo's config with its model resolved (the tiny one built), written where the learner reads it."""
    from grpo_fleet.learner.run.build import resolve_model_path
    from grpo_fleet.learner.verify.env_replay import check_verifiable
    from grpo_fleet.tasks import build_task

    cfg = demo_config(options)
    run_dir = Path(cfg.run_dir)
    task = build_task(cfg.task)
    check_verifiable(task.env, cfg.security.verify_rewards)  # refused here, in one line, before any process starts
    # A learner running there holds the lock: it is refused in one line before anything of its run is deleted.
    # Released once prepared, so that the demo's own learner can take it.
    with RunDirLock(run_dir):
        for stale in ("metrics.jsonl", "ledger.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
        return _resolved(cfg, run_dir, resolve_model_path(cfg, task))


def _resolved(cfg: RunConfig, run_dir: Path, resolved: str) -> tuple[RunConfig, Path]:
    """The config with the model path learner and actors load, written to RUN_DIR/demo-config.json."""
    model_path = local_model_path(resolved)
    if is_gguf_source(cfg.model.path):
        # Imported above into the run's cache; the learner and each actor still get the GGUF and import their own.
        model_path = model_reference(cfg.model.path, model_path)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_path})})
    config_path = run_dir / "demo-config.json"
    config_path.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return cfg, config_path


def run_demo(options: DemoOptions) -> dict:
    """Build the tiny model, measure, train with a real fleet, measure again, summarise."""
    from grpo_fleet.models.loading import latest_checkpoint
    from grpo_fleet.tasks import build_task

    started = time.monotonic()
    cfg, config_path = prepare(options)
    run_dir = Path(cfg.run_dir)
    print(f"held-out reward is measured at step 0, every {cfg.train.eval_every} steps and at the end "
          f"({len(build_task(cfg.task).eval)} prompts, {cfg.train.eval_mode})")
    with running(cfg, config_path, options.actors) as fleet:
        print(f"learner on {cfg.server.bind}, metrics http://127.0.0.1:{cfg.metrics.port}/metrics; "
              f"actors' metrics on ports {fleet.actor_ports}; logs in {run_dir}")
        records, failure = follow(fleet, cfg, options.progress)
    if failure is not None:
        print(f"the demo stopped: {failure.describe()}", file=sys.stderr)
        return {"ok": False, "stopped_by": failure.name, "returncode": failure.returncode}
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        print(f"the learner wrote no checkpoint; see {run_dir / 'learner.log'}", file=sys.stderr)
        return {"ok": False}
    rounds = load_eval_records(run_dir / "metrics.jsonl")
    if not rounds or rounds[0]["step"] != 0 or rounds[-1]["step"] != records[-1]["step"]:
        print(f"the learner did not write the eval rounds at step 0 and the end; see {run_dir / 'learner.log'}",
              file=sys.stderr)
        return {"ok": False}
    return summarise(cfg, records, rounds, time.monotonic() - started, checkpoint)


def summarise(cfg: RunConfig, records: list[dict], rounds: list[dict], wall: float, checkpoint: Path) -> dict:
    """summary.json from the step records and the eval rounds (the first is before training, the last after)."""
    from grpo_fleet.observe.plotting import plot_run

    run_dir = Path(cfg.run_dir)
    plot = run_dir / "curves.png"
    before, after = float(rounds[0]["eval_reward"]), float(rounds[-1]["eval_reward"])
    summary = {
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_curve": [[r["step"], r["eval_reward"]] for r in rounds],
        "steps": records[-1]["step"] if records else 0,
        "policy_version": records[-1]["policy_version"] if records else 0,
        "wall_seconds": wall,
        "train_seconds": records[-1]["wall_seconds"] if records else 0.0,
        "checkpoint": str(checkpoint),
        "plot": str(plot),
        # The demo's claim is that the fleet learns: no steps, or no rise in held-out reward, is a failure.
        "ok": bool(records) and after > before,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if records:
        plot_run(run_dir, plot)
    print(f"held-out reward: {before:.3f} -> {after:.3f} in {summary['steps']} steps, {wall:.0f}s wall")
    print(f"summary {run_dir / 'summary.json'}, plot {plot}, checkpoint {checkpoint}")
    print(export_hint(run_dir, is_gguf_source(cfg.model.path)))
    if not summary["ok"]:
        print("the held-out reward did not rise: the demo did not show learning (too few steps?)")
    return summary
