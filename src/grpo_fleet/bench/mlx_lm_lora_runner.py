"""Run mlx-lm-lora's GRPO trainer on a grpo-fleet task: executed by path with the baseline's own venv python.

    <venv>/bin/python mlx_lm_lora_runner.py JOB.json

The job (written by bench/mlx_lm_lora.py, which documents every choice made
here) carries the prompts already tokenized by grpo-fleet, each with the prompt
text and the columns its rewards get, the reward set, the trainer's arguments
and where to write. This script then does what mlx-lm-lora's own CLI does for
`--train-mode grpo` (load the model, LoRA on its last blocks, Adam,
`train_grpo`), except that the reward is one function registered in its registry
that scores with grpo-fleet's own reward code (our src is put on sys.path;
grpo_fleet.tasks needs nothing beyond the standard library and blake3).

Every `eval_every` steps (and at step 0 and the end) the adapters are saved, with
the clock stopped, and one line goes to progress.jsonl. Every step writes a line:
    {"step", "wall_seconds", "completions", "train_reward", "mean_tokens", "unscored", "adapter"}
`adapter` is the adapter file of that step, or null. Evaluation happens later,
in grpo-fleet's process, with its own `evaluate`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Run by path, this file's folder would be sys.path[0] and its sibling modules could shadow real ones.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

REWARD_NAME = "grpo_fleet_reward"


class Clock:
    """Seconds since the bench launched this process, less the time spent saving snapshots."""

    def __init__(self, launched: float) -> None:
        self.launched = launched
        self.paused = 0.0

    def now(self) -> float:
        return time.time() - self.launched - self.paused

    def pause(self, started: float) -> None:
        self.paused += time.time() - started


class ProgressLog:
    """One JSON line per step; the adapters saved at snapshot steps."""

    def __init__(self, model: Any, job: dict[str, Any], clock: Clock) -> None:
        self.model = model
        self.out_dir = Path(job["out_dir"])
        self.every = int(job["eval_every"])
        self.steps = int(job["trainer"]["iters"])
        self.per_step = int(job["trainer"]["batch_size"]) * int(job["trainer"]["group_size"])
        self.clock = clock
        self.unscored = 0
        (self.out_dir / "adapters").mkdir(parents=True, exist_ok=True)
        self.handle = (self.out_dir / "progress.jsonl").open("w", encoding="utf-8")

    def record(self, step: int, info: Optional[dict[str, Any]] = None) -> None:
        wall = self.clock.now()
        adapter = self._snapshot(step) if step == 0 or step % self.every == 0 or step == self.steps else None
        info = info or {}
        line = {"step": step, "wall_seconds": wall, "completions": step * self.per_step,
                "train_reward": info.get("train_total_rewards_mean"), "mean_tokens": info.get("train_average_generated_tokens"),
                "unscored": self.unscored, "adapter": adapter}
        self.handle.write(json.dumps(line) + "\n")
        self.handle.flush()

    def _snapshot(self, step: int) -> str:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        started = time.time()
        path = self.out_dir / "adapters" / f"step_{step:06d}.safetensors"
        mx.save_safetensors(str(path), dict(tree_flatten(self.model.trainable_parameters())))
        self.clock.pause(started)
        return str(path)


def reward_adapter(rows: list[dict[str, Any]], job: dict[str, Any], log: ProgressLog) -> Any:
    """An mlx-lm-lora reward function that scores each completion with grpo-fleet's InlineScorer.

    `types` carries each completion's row index (the dataset's fifth field). A
    completion grpo-fleet could not score (a reward failed, or every reward said
    None) gets 0.0 and is counted: the fleet would re-queue its group instead.
    """
    from grpo_fleet.tasks.reward_runner import InlineScorer, RewardSet
    from grpo_fleet.tasks.scoring import ScoringJob

    spec = job["rewards"]
    scorer = InlineScorer(RewardSet(names=tuple(spec["names"]), weights=tuple(spec["weights"]), module=spec["module"],
                                    timeout_seconds=float(spec["timeout_seconds"]), bound=float(spec["bound"])))

    def grpo_fleet_reward(prompts: list, completions: list, answer: list, types: Optional[list] = None) -> list:
        assert types is not None, "the dataset's fifth field (the row index) is missing"
        jobs = [ScoringJob(prompt=rows[i]["prompt"], columns=rows[i]["columns"], completions=[text])
                for text, i in zip(completions, types)]
        scores = [s.rewards[0] if s.rewards is not None else None for s in scorer.score(jobs)]
        log.unscored += sum(1 for s in scores if s is None)
        return [0.0 if s is None else s for s in scores]

    return grpo_fleet_reward


class Reporter:
    """mlx-lm-lora's TrainingCallback: steps_per_report is 1, so this sees every step."""

    def __init__(self, log: ProgressLog) -> None:
        self.log = log

    def on_train_loss_report(self, train_info: dict[str, Any]) -> None:
        self.log.record(int(train_info["iteration"]), train_info)

    def on_val_loss_report(self, val_info: dict[str, Any]) -> None:
        """No validation set is given to the trainer; evaluation is grpo-fleet's."""


def load_models(job: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Policy with LoRA (as mlx_lm_lora.utils.from_pretrained, plus our keys), tokenizer, frozen reference."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    loaded = load(job["model_dir"])
    model, tokenizer = loaded[0], loaded[1]
    model.freeze()
    lora = job["lora"]
    linear_to_lora_layers(model, lora["num_layers"], lora["parameters"])
    # The CLI always loads a second copy as the reference; it is only ever used with beta > 0.
    reference = load(job["model_dir"])[0].freeze() if job["trainer"]["beta"] > 0 else None
    return model, tokenizer, reference


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    if job.get("cpu") is not None:  # one core for one Mac; before MLX and BLAS start their threads, which inherit it
        os.sched_setaffinity(0, {int(job["cpu"])})
    clock = Clock(float(job["launched"]))
    sys.path.insert(0, job["grpo_src"])

    import mlx.core as mx
    import mlx.optimizers as optim
    import numpy as np
    from mlx_lm_lora.trainer.grpo_reward_functions import get_reward_function, register_reward_function
    from mlx_lm_lora.trainer.grpo_trainer import GRPOTrainingArgs, train_grpo

    np.random.seed(job["seed"])  # the CLI's run(): batch order
    mx.random.seed(job["seed"])  # the CLI's train_model(): sampling
    model, tokenizer, reference = load_models(job)
    rows = [json.loads(line) for line in Path(job["train_rows"]).read_text(encoding="utf-8").splitlines() if line]
    # mlx-lm-lora's GRPO example: (prompt tokens, answer tokens, prompt text, answer text, type); type = row index.
    dataset: list[tuple[Any, ...]] = [
        (row["tokens"], [], row["prompt"], str(row["columns"].get("answer", "")), i) for i, row in enumerate(rows)
    ]
    log = ProgressLog(model, job, clock)
    register_reward_function(REWARD_NAME)(reward_adapter(rows, job, log))
    log.record(0)
    trainer = dict(job["trainer"], adapter_file=str(Path(job["out_dir"]) / "adapters.safetensors"))
    train_grpo(model=model, ref_model=reference, tokenizer=tokenizer,
               optimizer=optim.Adam(learning_rate=float(job["lr"])),  # the CLI's default optimizer, no extra config
               train_dataset=dataset, val_dataset=None, reward_funcs=[get_reward_function(REWARD_NAME)],
               args=GRPOTrainingArgs(**trainer), training_callback=Reporter(log),
               end_answer_token=job["end_answer_token"])
    log.handle.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: mlx_lm_lora_runner.py JOB.json")
    main(sys.argv[1])
