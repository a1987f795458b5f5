"""What each process of a run does when it runs alone: the fleet simulator's inputs for a shared host.

On this VM the learner and the actors share two cores, so the speeds a fleet
run shows are each other's contention, not the processes' own. This measures
them one at a time, in this process, on the run's own model, task and
settings, once the run has ended (nothing else is busy):
- the actor's path (`generate_groups`, LoRA policy) generating leases of one
  group and of `server.max_groups_per_lease`: a lease's groups are decoded as
  one batch, so a lease costs a part its size hardly changes (the decoding
  steps) plus a little a group, and the two sizes give both;
- the logprob check (`LogprobCheck.gaps`) of a step's groups together, as the
  learner runs it before a step, per group;
- the learner's step (`trainer_from_config`) on `groups_per_step` groups, after a
  warm-up step.

Each comes with the cores it kept busy: CPU seconds over wall seconds.

`measure_alone_as_fleet` measures them in a child process with the fleet's own
environment (`launch/local_fleet.py: fleet_env`: one OpenBLAS thread, as the run's learner
and actors had), not in the bench process with OpenBLAS's default threads:
speeds and cores measured under other threads are not the run's processes'.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np

from grpo_fleet.config import RunConfig, load_run_config
from grpo_fleet.launch.local_fleet import fleet_env
from grpo_fleet.learner.records.groups import AcceptedGroup, CompletionRecord
from grpo_fleet.learner.run.build import resolve_model_path, tokenize_prompts
from grpo_fleet.learner.step.batch import build_train_batch
from grpo_fleet.learner.step.trainer import Trainer, load_trainer
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, WeightHistory
from grpo_fleet.models.generation import SamplingSettings, generate_groups
from grpo_fleet.models.loading import load_policy
from grpo_fleet.tasks import build_task

LEASES = 6
STEPS = 3


@dataclass(frozen=True)
class Timed:
    seconds: float  # wall
    cores: float  # CPU seconds over wall seconds: how many cores it kept busy

    def unstarved(self) -> "Timed":
        """What it takes with the host to itself. Under a core, a process of one BLAS thread (the fleet's
        environment) was waiting for the CPU other work held: alone it runs its CPU seconds on one core."""
        return self if self.cores >= 1.0 else Timed(self.seconds * self.cores, 1.0)


@dataclass(frozen=True)
class AloneSpeeds:
    """A run's processes, each measured alone."""

    group: Timed  # the actor: each group of a lease, past its fixed part
    lease: Timed  # the actor: the part of a lease its size hardly changes
    step: Timed  # the learner's step on groups_per_step groups
    logprob_check: Timed  # the learner's check of one group

    @classmethod
    def from_json(cls, text: str) -> "AloneSpeeds":
        data = json.loads(text)
        return cls(**{name: Timed(**data[name]) for name in ("group", "lease", "step", "logprob_check")})


def timed(work: Callable[[], object]) -> Timed:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    seconds = time.perf_counter() - wall
    return Timed(seconds, (time.process_time() - cpu) / seconds if seconds > 0 else 0.0)


def mean(runs: list[Timed], per: int = 1) -> Timed:
    seconds = sum(r.seconds for r in runs)
    return Timed(seconds / (len(runs) * per), sum(r.cores * r.seconds for r in runs) / seconds)


def _accepted(prompts: list[list[int]], groups: list[Any], first_index: int) -> list[AcceptedGroup]:
    """Generated groups as the learner holds them; rewards spread 0..1 in each group so every group trains."""
    return [
        AcceptedGroup(
            group_id=f"g{first_index + i}", prompt_index=first_index + i, prompt_tokens=np.asarray(prompt, np.int32),
            completions=[CompletionRecord(np.asarray(c.tokens, np.int32), np.asarray(c.logprobs, np.float32),
                                          j / max(1, len(group) - 1), c.finish_reason) for j, c in enumerate(group)],
            policy_version=0, actor_id="alone",
        )
        for i, (prompt, group) in enumerate(zip(prompts, groups))
    ]


def _generated(model: Any, prompts: list[list[int]], settings: SamplingSettings) -> tuple[Timed, list[Any]]:
    out: list[Any] = []
    return timed(lambda: out.extend(generate_groups(model, prompts, settings))), out


def _actor_alone(cfg: RunConfig, path: str) -> tuple[Timed, Timed, list[AcceptedGroup]]:
    """(a group, a lease's fixed part, the groups generated): LEASES leases of 1 group and of
    server.max_groups_per_lease, of the run's first prompts, on the actor's path."""
    lora = cfg.lora if cfg.lora.enabled else None
    policy = load_policy(path, lora=lora, dtype=cfg.model.dtype)
    prompts = [p.tolist() for p in tokenize_prompts(policy.tokenizer, build_task(cfg.task), cfg)]
    gen = cfg.generation
    settings = SamplingSettings(group_size=gen.group_size, max_tokens=gen.max_tokens, temperature=gen.temperature,
                                top_p=gen.top_p, stop_token_ids=sorted(policy.tokenizer.eos_token_ids))
    generate_groups(policy.model, prompts[:1], settings)  # warm-up
    accepted: list[AcceptedGroup] = []
    sizes = (1, max(2, cfg.server.max_groups_per_lease))
    leases = {}
    for size in sizes:
        runs: list[Timed] = []
        for lease in range(LEASES):
            first = (lease * size) % max(1, len(prompts) - size)
            chosen = prompts[first: first + size]
            run, out = _generated(policy.model, chosen, settings)
            runs.append(run)
            accepted += _accepted(chosen, out, len(accepted))
        leases[size] = mean(runs)
    small, large = leases[sizes[0]], leases[sizes[1]]
    cores = (small.cores + large.cores) / 2
    group = max(0.0, (large.seconds - small.seconds) / (sizes[1] - sizes[0]))
    return Timed(group, cores), Timed(max(0.0, small.seconds - group), cores), accepted


def _step(trainer: Trainer, groups: list[AcceptedGroup]) -> None:
    trainer.step(build_train_batch(groups))


def _learner_alone(cfg: RunConfig, path: str, groups: list[AcceptedGroup]) -> tuple[Timed, Timed]:
    """(one step, one group's logprob check) on the learner's own objects."""
    trainer = load_trainer(cfg, path)
    history = WeightHistory(trainer.policy.model, keep=1)
    history.record(0)
    check = LogprobCheck(trainer.policy.model, history, temperature=cfg.generation.temperature,
                         chunk_tokens=cfg.train.logprob_chunk_tokens, micro_batch_tokens=cfg.train.micro_batch_tokens)
    size = cfg.grpo.groups_per_step
    batches = [groups[(i * size) % len(groups):][:size] for i in range(STEPS + 1)]
    check.gaps(batches[0])  # warm-up
    # As the learner checks a batch's flagged groups: together, one forward per claimed version.
    checks = [mean([timed(partial(check.gaps, batch))], per=len(batch)) for batch in batches[1:]]
    trainer.step(build_train_batch(batches[0]))  # warm-up, as the run's first step is left out
    steps = [timed(partial(_step, trainer, batch)) for batch in batches[1:]]
    return mean(steps), mean(checks)


def measure_alone(cfg: RunConfig) -> AloneSpeeds:
    """The run's actor, logprob check and learner step, each alone, on the run's model (cached by the run)."""
    path = resolve_model_path(cfg, build_task(cfg.task))
    group, lease, generated = _actor_alone(cfg, path)
    step, check = _learner_alone(cfg, path, generated)
    return AloneSpeeds(group=group, lease=lease, step=step, logprob_check=check)


def measure_alone_as_fleet(cfg: RunConfig) -> AloneSpeeds:
    """`measure_alone` in a child process with the environment the run's learner and actors had."""
    with tempfile.TemporaryDirectory(prefix="grpo-fleet-alone-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(cfg.model_dump(mode="json")))
        done = subprocess.run([sys.executable, "-m", "grpo_fleet.bench.alone", str(path)],
                              env=fleet_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"measuring alone failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return AloneSpeeds.from_json(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """`python -m grpo_fleet.bench.alone CONFIG.json`: the speeds as one JSON line on stdout."""
    print(json.dumps(asdict(measure_alone(load_run_config(argv[0])))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
