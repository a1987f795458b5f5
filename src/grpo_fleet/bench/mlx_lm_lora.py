"""Baseline: mlx-lm-lora's GRPO trainer (PyPI `mlx-lm-lora`) on the same model, task and budget as grpo-fleet.

`run_mlx_lm_lora(spec, out_dir)` trains with mlx-lm-lora in its own venv (made
once, cached, versions pinned below) and returns held-out reward against
wall-clock seconds, steps and completions. `LikeForLike` is what both sides
share; `apply_spec` writes it into a grpo-fleet `RunConfig` and `runner_job`
into mlx-lm-lora's arguments, so the two mappings sit side by side in this file.

How it stays like for like:
* Same prompts, same tokens: grpo-fleet tokenizes the train prompts (chat
  template, system prompt) and hands the runner the token ids; mlx-lm-lora's
  own dataset loader, with its R1 system prompt, is not used.
* Same reward: one function registered in mlx-lm-lora's reward registry scores
  each completion with grpo-fleet's InlineScorer over the task's rewards
  (weights, reward module and bound included).
* Same evaluation: the runner saves the adapters every `eval_every` steps (and
  at step 0 and the end) with the clock stopped; afterwards grpo-fleet's
  `evaluate` (the task's held-out prompts, in the run's train.eval_mode) scores each snapshot, as the
  e2e bench scores the fleet's checkpoints.
* Same clock: wall seconds run from just before the runner process is started
  (interpreter, imports and model load count, as they do for the fleet).
* Same B, G, max_tokens, temperature, lr, LoRA rank / scale / blocks / keys,
  beta, loss aggregation and seed (see `apply_spec` / `runner_job`), and the
  same mlx / mlx-lm versions as grpo-fleet's own venv.

Differences that cannot be removed without patching mlx-lm-lora:
* Sampler: its CLI builds GRPOTrainingArgs without top_p / top_k, so they stay
  at 0.95 / 20 (hard-coded for CLI users); `LikeForLike.their_sampler` keeps
  that (default), False passes 1.0 / 0 to sample as grpo-fleet does
  (grpo-fleet refuses top_p < 1: its ratios need the sampling distribution).
* Its logprobs in the loss are of softmax(logits), not softmax(logits / T):
  the same only at temperature 1.
* B: it takes B prompts per step whatever their rewards; grpo-fleet trains on B
  *informative* groups, sampling more prompts until zero-variance groups are
  replaced. Its zero-variance groups stay in the batch with advantage 0 (only
  their KL term acts), so with "grpo" aggregation they dilute the step.
  Completions per step are therefore B x G for it and >= B x G for grpo-fleet.
* Strictly on-policy: one update per batch, importance ratio fixed at 1, so its
  clip (epsilon) never acts; grpo-fleet's actors may be a version or two stale.
* Optimizer: Adam without gradient clipping (its CLI default); grpo-fleet uses
  AdamW (weight_decay 0 by default, the same as Adam) clipped at grad_clip.
* Loss names: grpo -> grpo, dapo -> bnpo (token mean), dr_grpo -> dr_grpo (but
  it keeps the std division in the advantages, which Dr. GRPO removes); it has
  no gspo.
* Prompt order: batches are runs of length-sorted prompts, shuffled as whole
  batches each epoch; grpo-fleet's scheduler shuffles prompts.
* Generation: mlx-lm's BatchGenerator decoding at most B sequences at once
  (its `completion_batch_size`), with a shared prompt cache per group;
  `end_answer_token` is "" so it stops on EOS only, as grpo-fleet does.
* Reference model: a second copy of the weights (loaded only when beta > 0);
  grpo-fleet switches the adapters off instead. Same k3 KL.
* A completion grpo-fleet cannot score gets reward 0.0 there (counted in
  progress.jsonl as `unscored`); the fleet re-queues such a group.

If the venv cannot be made (no package index), `BaselineUnavailable` says why,
so the bench row can be skipped with that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, cast

from grpo_fleet.bench.baseline_venv import BaselineUnavailable, ensure_venv
from grpo_fleet.config import RunConfig

RUNNER = Path(__file__).with_name("mlx_lm_lora_runner.py")
# grpo-fleet's loss_type -> mlx-lm-lora's grpo_loss_type (same aggregation).
LOSS_TYPES = {"grpo": "grpo", "dapo": "bnpo", "dr_grpo": "dr_grpo"}
THEIR_SAMPLER = {"top_p": 0.95, "top_k": 20}  # GRPOTrainingArgs' defaults; its CLI cannot change them
MATCHED_SAMPLER = {"top_p": 1.0, "top_k": 0}  # mlx-lm's make_sampler: both off
__all__ = ["BaselineUnavailable", "EvalPoint", "LikeForLike", "apply_spec", "run_mlx_lm_lora", "spec_from_config"]


@dataclass(frozen=True)
class LikeForLike:
    """What the fleet and the baseline share: model, task, budget and hyperparameters."""

    model_dir: str
    train_path: str
    eval_path: Optional[str]
    rewards: tuple[str, ...]
    reward_module: Optional[str] = None
    reward_weights: Optional[tuple[float, ...]] = None
    chat_template: bool = True
    system_prompt: Optional[str] = None
    num_eval: int = 64
    steps: int = 20
    prompts_per_step: int = 4  # B
    group_size: int = 4  # G
    max_tokens: int = 48
    temperature: float = 1.0
    lr: float = 1e-4
    lora_rank: int = 8
    lora_scale: float = 20.0
    lora_layers: int = -1  # the last N blocks; -1: all
    lora_keys: Optional[tuple[str, ...]] = None
    beta: float = 0.04
    epsilon: float = 0.2
    loss_type: str = "grpo"
    eval_every: int = 5
    seed: int = 0
    their_sampler: bool = True  # mlx-lm-lora's top_p 0.95 / top_k 20 (its CLI's); False: plain temperature sampling


# LikeForLike field -> grpo-fleet config field ("section.name"). Every shared setting goes through here.
CONFIG_FIELDS = {
    "model_dir": "model.path",
    "train_path": "task.train_path",
    "eval_path": "task.eval_path",
    "rewards": "task.rewards",
    "reward_module": "task.reward_module",
    "reward_weights": "task.reward_weights",
    "chat_template": "task.chat_template",
    "system_prompt": "task.system_prompt",
    "num_eval": "task.num_eval",
    "steps": "train.steps",
    "prompts_per_step": "grpo.groups_per_step",
    "group_size": "generation.group_size",
    "max_tokens": "generation.max_tokens",
    "temperature": "generation.temperature",
    "lr": "optim.lr",
    "lora_rank": "lora.rank",
    "lora_scale": "lora.scale",
    "lora_layers": "lora.num_layers",
    "lora_keys": "lora.keys",
    "beta": "grpo.beta",
    "epsilon": "grpo.epsilon_low",
    "loss_type": "grpo.loss_type",
    "eval_every": "train.eval_every",
    "seed": "train.seed",
}
# Not shared: the baseline's sampler choice has no grpo-fleet counterpart (grpo-fleet always samples plainly).
BASELINE_ONLY = ("their_sampler",)


@dataclass(frozen=True)
class EvalPoint:
    """Held-out reward of one snapshot, by when it was taken."""

    step: int
    wall_seconds: float
    completions: int
    reward: float


@dataclass(frozen=True)
class Snapshot:
    """One saved adapter file from the runner's progress.jsonl."""

    step: int
    wall_seconds: float
    completions: int
    adapter: str


def apply_spec(spec: LikeForLike, base: Optional[RunConfig] = None) -> RunConfig:
    """`base` (default: the defaults) with every shared setting of `spec`, a JSONL task and LoRA on."""
    data = (base or RunConfig()).model_dump(mode="python")
    for name, path in CONFIG_FIELDS.items():
        section, key = path.split(".")
        value = getattr(spec, name)
        data[section][key] = list(value) if isinstance(value, tuple) else value
    data["task"].update(name="jsonl", dataset=None)
    data["lora"]["enabled"] = True
    data["grpo"]["epsilon_high"] = spec.epsilon
    if spec.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {spec.loss_type!r}: mlx-lm-lora has {sorted(LOSS_TYPES)} only")
    return RunConfig.model_validate(data)


def spec_from_config(cfg: RunConfig, *, their_sampler: bool = True) -> LikeForLike:
    """The LikeForLike a (JSONL-task, LoRA) grpo-fleet config describes."""
    if cfg.task.name != "jsonl" or not cfg.task.train_path:
        raise ValueError(f"the baseline needs a JSONL task (task.name = 'jsonl'), got {cfg.task.name!r}")
    values: dict[str, Any] = {}
    for name, path in CONFIG_FIELDS.items():
        section, key = path.split(".")
        value = getattr(getattr(cfg, section), key)
        values[name] = tuple(value) if isinstance(value, list) else value
    values["epsilon"] = cfg.grpo.clip_range[0]
    return LikeForLike(**values, their_sampler=their_sampler)


def runner_job(spec: LikeForLike, cfg: RunConfig, *, train_rows: Path, out_dir: Path, launched: float,
               grpo_src: str, reward_module: Optional[str], reward_weights: list[float]) -> dict[str, Any]:
    """The runner's JSON job: the same settings as `cfg`, in mlx-lm-lora's terms."""
    sampler = THEIR_SAMPLER if spec.their_sampler else MATCHED_SAMPLER
    parameters: dict[str, Any] = {"rank": cfg.lora.rank, "scale": cfg.lora.scale, "dropout": cfg.lora.dropout}
    if cfg.lora.keys:
        parameters["keys"] = list(cfg.lora.keys)
    steps = cfg.train.steps
    low, high = cfg.grpo.clip_range
    return {
        "model_dir": cfg.model.path, "grpo_src": grpo_src, "train_rows": str(train_rows), "out_dir": str(out_dir),
        "launched": launched, "seed": cfg.train.seed, "lr": cfg.optim.lr, "eval_every": spec.eval_every,
        "end_answer_token": "",  # stop on EOS only, as grpo-fleet does (its default adds "</answer>")
        "lora": {"num_layers": cfg.lora.num_layers, "parameters": parameters},
        "rewards": {"names": list(cfg.task.rewards), "weights": reward_weights, "module": reward_module,
                    "timeout_seconds": cfg.task.reward_timeout_seconds, "bound": cfg.task.reward_bound},
        "trainer": {
            "batch_size": cfg.grpo.groups_per_step, "group_size": cfg.generation.group_size, "iters": steps,
            "max_completion_length": cfg.generation.max_tokens, "temperature": cfg.generation.temperature,
            **sampler, "beta": cfg.grpo.beta, "epsilon": low, "epsilon_high": high,
            "grpo_loss_type": LOSS_TYPES[cfg.grpo.loss_type],
            # Its report callback every step (our progress log); its own saves and validation never.
            "steps_per_report": 1, "steps_per_eval": steps + 1, "steps_per_save": steps + 1,
        },
    }


def parse_progress(lines: list[str]) -> list[Snapshot]:
    """The snapshot lines (those with an adapter) of a progress.jsonl, in step order."""
    snapshots = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("adapter"):
            snapshots.append(Snapshot(int(record["step"]), float(record["wall_seconds"]), int(record["completions"]),
                                      str(record["adapter"])))
    return sorted(snapshots, key=lambda s: s.step)


def step_seconds(lines: list[str]) -> list[float]:
    """Wall seconds of each training step (snapshot saving excluded), from a progress.jsonl."""
    records = [json.loads(line) for line in lines if line.strip()]
    return [b["wall_seconds"] - a["wall_seconds"] for a, b in zip(records, records[1:])]


def completions_per_second(lines: list[str]) -> float:
    """Training completions per wall second from step 1 on (start-up and snapshot saving excluded)."""
    records = [json.loads(line) for line in lines if line.strip()]
    first = next((r for r in records if r["step"] == 0), None)
    last = max(records, key=lambda r: r["step"]) if records else None
    if first is None or last is None or last["step"] == 0:
        return float("nan")
    return (last["completions"] - first["completions"]) / max(last["wall_seconds"] - first["wall_seconds"], 1e-9)


def run_mlx_lm_lora(spec: LikeForLike, out_dir: Path, *, base: Optional[RunConfig] = None,
                    timeout_seconds: float = 6 * 3600, cpu: Optional[int] = None) -> list[EvalPoint]:
    """Train with mlx-lm-lora on `spec` in its own venv; held-out reward of each snapshot.

    `cpu` pins the trainer to that one core with one BLAS thread (Linux): one core standing for one Mac.
    Raises BaselineUnavailable when its venv cannot be made.
    """
    from grpo_fleet.tasks import build_task

    cfg = apply_spec(spec, base)
    task = build_task(cfg.task)
    python = ensure_venv()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / "train_rows.jsonl"
    write_train_rows(cfg, task, rows_path)
    job_path = out_dir / "job.json"
    launched = time.time()
    job = runner_job(spec, cfg, train_rows=rows_path, out_dir=out_dir, launched=launched,
                     grpo_src=str(Path(__file__).resolve().parents[2]), reward_module=task.reward_module,
                     reward_weights=task.reward_weights) | {"cpu": cpu}
    job_path.write_text(json.dumps(job, indent=1), encoding="utf-8")
    _run_runner(python, job_path, out_dir, timeout_seconds, one_thread=cpu is not None)
    snapshots = parse_progress((out_dir / "progress.jsonl").read_text(encoding="utf-8").splitlines())
    return evaluate_snapshots(cfg, task, snapshots)


def write_train_rows(cfg: RunConfig, task: Any, path: Path) -> None:
    """Each train prompt as grpo-fleet tokenizes it, with the text and columns its rewards get."""
    from mlx_lm.utils import load_tokenizer

    from grpo_fleet.learner.run.build import tokenize_prompts

    tokenizer = load_tokenizer(Path(cfg.model.path))
    tokens = tokenize_prompts(tokenizer, task, cfg)
    with path.open("w", encoding="utf-8") as handle:
        for example, ids in zip(task.train, tokens):
            job = task.job(example, [])
            handle.write(json.dumps({"tokens": ids.tolist(), "prompt": job.prompt, "columns": dict(job.columns)}) + "\n")


def _run_runner(python: Path, job_path: Path, out_dir: Path, timeout_seconds: float, *, one_thread: bool = False) -> None:
    from grpo_fleet.runtime.blas import child_env

    env = child_env()
    env.pop("PYTHONPATH", None)  # the runner puts only grpo_fleet's src on its path, after its own packages
    env["PYTHONUNBUFFERED"] = "1"
    if one_thread:  # pinned to one core: more BLAS threads would only take turns on it
        env["OPENBLAS_NUM_THREADS"] = "1"
    with (out_dir / "runner.log").open("w", encoding="utf-8") as log:
        done = subprocess.run([str(python), str(RUNNER), str(job_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=env, timeout=timeout_seconds, check=False)
    if done.returncode != 0:
        tail = (out_dir / "runner.log").read_text(encoding="utf-8", errors="replace")[-2000:]
        raise RuntimeError(f"mlx-lm-lora runner exited {done.returncode}; end of {out_dir / 'runner.log'}:\n{tail}")


def evaluate_snapshots(cfg: RunConfig, task: Any, snapshots: list[Snapshot]) -> list[EvalPoint]:
    """grpo-fleet's held-out reward (train.eval_mode, as the fleet's rounds) of each saved adapter file."""
    import mlx.core as mx

    from grpo_fleet.models.evaluate import evaluate
    from grpo_fleet.models.loading import load_policy

    policy = load_policy(cfg.model.path, lora=cfg.lora, dtype=cfg.model.dtype)
    points = []
    for snapshot in snapshots:
        adapters = cast(dict[str, mx.array], mx.load(snapshot.adapter))
        policy.model.load_weights(list(adapters.items()), strict=False)
        reward = evaluate(policy.model, policy.tokenizer, task, cfg)
        points.append(EvalPoint(snapshot.step, snapshot.wall_seconds, snapshot.completions, reward))
    return points


def spec_from_json(text: str) -> LikeForLike:
    """A LikeForLike from a JSON object of its fields (lists become tuples)."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}
    return LikeForLike(**values)


def main() -> None:
    """By hand: python -m grpo_fleet.bench.mlx_lm_lora SPEC.json OUT_DIR; prints one JSON EvalPoint a line."""
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m grpo_fleet.bench.mlx_lm_lora SPEC.json OUT_DIR")
    for point in run_mlx_lm_lora(spec_from_json(Path(sys.argv[1]).read_text()), Path(sys.argv[2])):
        print(json.dumps(asdict(point)), flush=True)


if __name__ == "__main__":
    main()
