"""How often the logprob check catches the quiet lies, and how long a sleeper liar goes unseen.

Liars whose weights are 1 or 2 versions behind the version they claim (a proxy
that lifts the claimed version, or serves stale weights) are only a few
hundredths of a nat per token off on the demo model. In one process, the demo
task trains on-policy; at each probe version v, submissions of
`max_groups_per_lease` groups are sampled from the weights of v - lag and
claimed as v, in float32 (a CPU actor) and in bfloat16 (a Mac's), then
recomputed the way the learner does it (`LogprobCheck` under the weights of v).
From each honest submission (lag 0) two more liars are made:

- spikes: 1% of each group's tokens (at least one) reported `SPIKE_NATS` lower
  than sampled, the rest honest: the ratio of those tokens is what the lie buys;
- a cut-off completion claimed finished (`length` sent as `stop`), which would
  escape grpo.mask_truncated (only submissions that hold a cut-off one).

Each submission is judged as an actor on probation is: every group checked,
against the bound the learner calibrates at start for the actor's dtype (honest
groups the learner samples itself at version 0, `gap_calibration.calibrate`),
on the mean and on every token, and every `finish_reason` against its tokens.
A group is checked whole when the step trains from the version it claims (the
step's own forward), or security.check_completions of its completions, picked at
random, when it is older (a forward of its own): both are judged. Beside them,
the judge before issue 26: the mean alone against one constant per dtype pair,
on up to 4 random groups. Lag 0 is the honest actor: anything caught there is a
false rejection.

The sleeper: an actor that turns liar right after its probation, each lying
group checked with probability security.check_share, drawn by the learner's own
`Trust`; the groups it trains before the first checked one, over many trials.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map, tree_unflatten

from grpo_fleet.bench import Figure, Report, Scale
from grpo_fleet.bench.e2e import TrainLoop, batched_rollout, demo_run_config
from grpo_fleet.config import SecurityConfig
from grpo_fleet.learner.records.groups import AcceptedGroup
from grpo_fleet.learner.run.build import resolve_model_path
from grpo_fleet.learner.step.gap_bounds import GapBound, default_bound, logprob_gap_bound
from grpo_fleet.learner.verify.actor_checks import LogprobCheck, WeightHistory
from grpo_fleet.learner.verify.gap_calibration import calibrate
from grpo_fleet.learner.verify.trust import Trust, expected_exposure
from grpo_fleet.models.loading import load_policy
from grpo_fleet.protocol.messages import finish_reason_mismatch
from grpo_fleet.tasks import build_task

BENCH = "liar_lags"
OLD_CHECKS = 4  # security.logprob_checks_per_submission before issue 26: random groups of a submission
LAGS = (0, 1, 2)
DTYPES = ("float32", "bfloat16")
SPIKE_SHARE, SPIKE_NATS = 0.01, 20.0
SLEEPER_TRIALS = 100_000
WHOLE, PART = "whole groups (the step's version)", "part of each group (an older version)"
SCREENED = "under the step's screen (security.screen_token_nats)"


@dataclass(frozen=True)
class Judged:
    """One submission as the learner sees it: each group's (mean, worst token) gap, and any false finish_reason."""

    gaps: list[tuple[float, float]]
    finish_lie: bool = False

    def caught(self, bound: GapBound) -> bool:
        return self.finish_lie or any(bound.judge(mean, worst) is not None for mean, worst in self.gaps)

    def caught_before(self, bound: float, picker: random.Random) -> bool:
        """The judge before issue 26: the mean of up to OLD_CHECKS random groups against one constant."""
        return any(mean > bound for mean, _ in picker.sample(self.gaps, min(OLD_CHECKS, len(self.gaps))))


def judged(check: LogprobCheck, groups: list[AcceptedGroup], stop_ids: frozenset[int], max_tokens: int) -> Judged:
    found = check.gaps(groups)
    assert all(gap is not None for gap in found), "every claimed version is kept"
    lie = any(finish_reason_mismatch(c.tokens, c.finish_reason, stop_ids, max_tokens)
              for g in groups for c in g.completions)
    return Judged([(g.mean, g.max) for g in found if g is not None], lie)


def spiked(group: AcceptedGroup, rng: np.random.Generator) -> AcceptedGroup:
    """`group` with SPIKE_SHARE of its tokens (at least one) reported SPIKE_NATS lower."""
    sizes = [len(c.logprobs) for c in group.completions]
    chosen = rng.choice(sum(sizes), size=max(1, round(SPIKE_SHARE * sum(sizes))), replace=False)
    flat = np.concatenate([c.logprobs for c in group.completions]).astype(np.float32)
    flat[chosen] -= SPIKE_NATS
    parts = np.split(flat, np.cumsum(sizes)[:-1])
    return replace(group, completions=[replace(c, logprobs=p) for c, p in zip(group.completions, parts)])


def part_of(group: AcceptedGroup, count: int, picker: random.Random) -> AcceptedGroup:
    """`count` of `group`'s completions, at random, as a forward check recomputes them (0: all)."""
    if count == 0 or count >= len(group.completions):
        return group
    return replace(group, completions=picker.sample(group.completions, count))


def finished_claim(group: AcceptedGroup) -> AcceptedGroup:
    """`group` with every cut-off completion claimed finished."""
    return replace(group, completions=[replace(c, finish_reason="stop") for c in group.completions])


def cast(flat: list[tuple[str, mx.array]], dtype: str) -> Any:
    """Kept weights as the tree an actor sampling in `dtype` loads."""
    target = getattr(mx, dtype)
    return tree_map(lambda w: w.astype(target), tree_unflatten(flat))


def sleeper_exposure(share: float, probation: int, trials: int) -> np.ndarray:
    """Groups a sleeper trains before its first checked lie, per trial, as the learner's `Trust` draws them."""
    out = np.zeros(trials, np.int64)
    for trial in range(trials):
        trust = Trust(probation, share)
        trust.begin_probation("sleeper")
        while trust.on_probation("sleeper"):  # honest while on probation: every group checked, and passed
            trust.record_pass("sleeper")
        while not trust.wants_check("sleeper"):
            out[trial] += 1
    return out


def report_sleeper(report: Report, trials: int) -> None:
    security = SecurityConfig()
    trained = sleeper_exposure(security.check_share, security.probation_groups, trials)
    expected = expected_exposure(security.check_share)
    report.add(Figure(BENCH, "sleeper liar after probation: lying groups trained before the ban, mean",
                      float(trained.mean()), "groups", baseline=expected, baseline_name="(1 - p) / p",
                      goal="<= 4 expected",
                      notes=f"{trials} trials of the learner's Trust (probation {security.probation_groups}, share "
                      f"{security.check_share}); worst case: every lying group older than the step's version "
                      "(a group at it is checked in the step for nothing)"))
    report.add(Figure(BENCH, "sleeper liar after probation: lying groups trained before the ban, 99th percentile",
                      float(np.percentile(trained, 99)), "groups",
                      baseline=float(np.ceil(np.log(0.01) / np.log(1 - security.check_share))),
                      baseline_name="k with (1 - p)^k = 1%", notes=f"largest of {trials}: {int(trained.max())}"))


def calibrated_bounds(loop: TrainLoop) -> dict[str, GapBound]:
    """The bound for each actor dtype, calibrated as the learner does at start (version 0)."""
    train = loop.cfg.train
    prompts = loop.prompts[: loop.cfg.security.calibration_prompts]
    return {dtype: calibrate(loop.policy.model, prompts, loop.settings, dtype=dtype,
                             ceiling=default_bound(dtype, "float32"), chunk_tokens=train.logprob_chunk_tokens,
                             micro_batch_tokens=train.micro_batch_tokens).bound for dtype in DTYPES}


@dataclass
class Probe:
    """What one probe needs: the loop, the check, and where the judged submissions go by (dtype, kind)."""

    loop: TrainLoop
    check: LogprobCheck
    size: int
    rng: np.random.Generator
    picker: random.Random
    judged: dict[tuple[str, str, str], list[Judged]]

    def judge(self, dtype: str, kind: str, groups: list[AcceptedGroup]) -> None:
        """Judged whole, and as a forward check would see it (check_completions of each group)."""
        settings, count = self.loop.settings, self.loop.cfg.security.check_completions
        stops = frozenset(settings.stop_token_ids)
        for how, seen in ((WHOLE, groups), (PART, [part_of(g, count, self.picker) for g in groups])):
            self.judged.setdefault((dtype, kind, how), []).append(judged(self.check, seen, stops, settings.max_tokens))

    def screen(self, dtype: str, kind: str, groups: list[AcceptedGroup]) -> None:
        """Older groups against the weights of the step that trains them: every token, every completion."""
        stops = frozenset(self.loop.settings.stop_token_ids)
        self.judged.setdefault((dtype, kind, SCREENED), []).append(
            judged(self.check, groups, stops, self.loop.settings.max_tokens))

    def submission(self, sampler: Any, dtype: str, lag: int, version: int) -> None:
        """One submission sampled by `sampler`, claimed as `version`; from an honest one, the two made-up liars."""
        groups = self.loop.batch(sampler, batched_rollout)[: self.size]
        for group in groups:
            group.policy_version = version
        self.judge(dtype, "honest" if lag == 0 else f"weights {lag} version{'s' if lag > 1 else ''} stale", groups)
        if lag:  # the same groups, claimed as what they are: sampled `lag` versions before the step that screens them
            old = f"{lag} version{'s' if lag > 1 else ''} old"
            self.screen(dtype, f"honest, {old}", groups)
            self.screen(dtype, f"spikes of {SPIKE_NATS:g} nats on {SPIKE_SHARE:.0%} of tokens, {old}",
                        [spiked(g, self.rng) for g in groups])
            return
        self.judge(dtype, f"spikes of {SPIKE_NATS:g} nats on {SPIKE_SHARE:.0%} of tokens",
                   [spiked(g, self.rng) for g in groups])
        if any(c.truncated for g in groups for c in g.completions):
            self.judge(dtype, "a cut-off completion claimed finished", [finished_claim(g) for g in groups])


def run(report: Report, scale: Scale) -> None:
    report_sleeper(report, 2_000 if scale is Scale.QUICK else SLEEPER_TRIALS)
    warmup, probes, per_probe = (40, 3, 3) if scale is Scale.QUICK else (100, 6, 5)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-liars-") as tmp:
        cfg = demo_run_config(Path(tmp), warmup + probes, seed=0)
        model_path = resolve_model_path(cfg, build_task(cfg.task))
        loop = TrainLoop.build(cfg, model_path)
        bounds = calibrated_bounds(loop)
        history = WeightHistory(loop.policy.model, keep=max(LAGS))
        check = LogprobCheck(loop.policy.model, history, temperature=cfg.generation.temperature,
                             chunk_tokens=cfg.train.logprob_chunk_tokens,
                             micro_batch_tokens=cfg.train.micro_batch_tokens)
        probe = Probe(loop, check, cfg.server.max_groups_per_lease, np.random.default_rng(0), random.Random(0), {})
        samplers = {dtype: load_policy(model_path, dtype=dtype) for dtype in DTYPES}
        for version in range(1, warmup + probes + 1):
            loop.train(loop.batch(loop.policy, batched_rollout))
            history.record(version)
            if version <= warmup:
                continue
            for dtype, sampler in samplers.items():
                for lag in LAGS:
                    sampler.model.update(cast(history.versions[version - lag], dtype))
                    for _ in range(per_probe):
                        probe.submission(sampler, dtype, lag, version)
            print(f"liar_lags v{version}: submissions judged", {k: len(v) for k, v in probe.judged.items()}, flush=True)
    _report(report, probe.judged, bounds, probe.size, cfg.security.screen_token_nats)


def _report(report: Report, judged_by: dict[tuple[str, str, str], list[Judged]], bounds: dict[str, GapBound],
            size: int, screen: float) -> None:
    picker = random.Random(0)
    for (dtype, kind, how), submissions in judged_by.items():
        if how == SCREENED:
            _report_screen(report, dtype, kind, submissions, screen)
            continue
        bound, honest = bounds[dtype], kind == "honest"
        caught = sum(s.caught(bound) for s in submissions)
        before = sum(s.caught_before(logprob_gap_bound(dtype, "float32"), picker) for s in submissions)
        means = [mean for s in submissions for mean, _ in s.gaps]
        worst = [w for s in submissions for _, w in s.gaps]
        what = "false rejections of honest submissions" if honest else "submissions caught"
        report.add(Figure(
            BENCH, f"{dtype} actor, {kind}, {how}: {what}", float(caught), "submissions",
            baseline=float(before), baseline_name="judged as before issue 26", goal="0" if honest else
            f">= {len(submissions) - 1} of {len(submissions)}",
            notes=f"{caught} of {len(submissions)} submissions of {size} groups, every group judged against the "
            f"calibrated bound {bound.mean:.4f} mean / {bound.token:.3f} a token; group means {min(means):.4f}-"
            f"{max(means):.4f}, worst tokens {min(worst):.3f}-{max(worst):.3f} nats; before: the mean of up to "
            f"{OLD_CHECKS} groups against {logprob_gap_bound(dtype, 'float32')}",
        ))


def _report_screen(report: Report, dtype: str, kind: str, submissions: list[Judged], screen: float) -> None:
    """Older groups under the step's screen: honest ones it sends to be recomputed (a wasted step each, no ban),
    and spiked ones it catches."""
    worst = [w for s in submissions for _, w in s.gaps]
    if kind.startswith("honest"):
        alarms = sum(w > screen for w in worst)
        report.add(Figure(BENCH, f"{dtype} actor, {kind}, {SCREENED}: groups over the screen", float(alarms), "groups",
                          goal="0 (each costs one step, never a ban)",
                          notes=f"{alarms} of {len(worst)} groups; worst token drift {min(worst):.3f}-{max(worst):.3f} "
                          f"nats against the screen's {screen:g}"))
        return
    caught = sum(any(w > screen for _, w in s.gaps) for s in submissions)
    report.add(Figure(BENCH, f"{dtype} actor, {kind}, {SCREENED}: submissions caught", float(caught), "submissions",
                      goal=f"{len(submissions)} of {len(submissions)}",
                      notes=f"{caught} of {len(submissions)}; worst tokens {min(worst):.2f}-{max(worst):.2f} nats, "
                      f"the screen {screen:g}; every group is screened, checked or not"))
