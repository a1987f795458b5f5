"""How many Macs, and how many learner ranks: the simulator swept over actor counts and rank counts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from grpo_fleet.config import SecurityConfig
from grpo_fleet.simulator.lengths import LengthSpec
from grpo_fleet.simulator.published import LOGPROB_CHECK_SHARE, MODELS, learner_tokens_per_second, lora_gradient_bytes
from grpo_fleet.simulator.simulation import simulate
from grpo_fleet.simulator.specs import ActorSpec, CheckSpec, FleetRules, RunSpec, SimResult, completions_share

SECURITY = SecurityConfig()
SATURATED = 0.95  # "one learner saturates" where more actors add less than 5% more steps/s


@dataclass(frozen=True)
class PlanShape:
    """The run being planned: the config's group size and lengths, and the fleet's rules (its batch among them)."""

    group_size: int = 8
    prompt_tokens: int = 150
    completion_tokens: int = 384  # every completion's length, or, with `lengths`, the most (max_tokens)
    rules: FleetRules = field(default_factory=lambda: FleetRules(groups_per_step=16))
    lengths: Optional[LengthSpec] = None  # drawn per completion (plan_lengths); None: all completion_tokens long


@dataclass(frozen=True)
class PlanInputs:
    """Where the speeds come from; every default is a published or measured figure (simulator.published)."""

    model: str = "qwen2.5-0.5b"
    mac: str = "m5-max"
    batch_speedup: float = 1.0  # batched decode of a group over batch-1 tokens/s (1: none, a lower bound)
    learner_tok_s: Optional[float] = None  # trained tokens/s of one rank; None: this VM's measured figure
    link_gbps: float = 10.0  # between learner ranks and to actors (10 GbE; Thunderbolt 5 is 80)
    logprob_check: bool = True  # security.verify_logprobs
    check_share: float = CheckSpec.share  # security.check_share: older groups drawn for a forward after probation
    check_completions: int = SECURITY.check_completions  # security.check_completions: of a group's G, what a forward recomputes
    # The check's forward of one group over that group's part of a one-rank step (measured: bench fleet_sim)
    check_forward_share: float = LOGPROB_CHECK_SHARE
    # At drawn lengths, the share of the padding to a batch's longest completion the learner's step pays
    # (0: rows packed, as issue 38 has the learner do; 1: every row padded to the longest)
    padding: float = 0.0


@dataclass(frozen=True)
class PlanRow:
    ranks: int
    actors: int
    steps_per_second: float
    learner_busy: float
    actor_busy: float
    forward_fraction: float  # trained groups the check recomputed at an older version
    check_seconds_per_step: float  # those forwards, on the slowest rank


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]
    step_seconds: dict[int, float]  # by rank count
    check_seconds: float  # the logprob check's forward of one older group, on one rank
    actor_seconds_per_group: float
    saturating_actors: dict[int, int]  # by rank count: the fewest actors within 5% of the most steps/s
    learner_extrapolated: bool


def actor_seconds_per_group(inputs: PlanInputs, shape: PlanShape) -> float:
    model = MODELS[inputs.model]
    return shape.group_size * shape.completion_tokens / (model.decode_tok_s[inputs.mac] * inputs.batch_speedup)


def step_seconds(inputs: PlanInputs, shape: PlanShape, ranks: int) -> tuple[float, bool]:
    """One step at `ranks` ranks: the batch split evenly, plus a ring all-reduce of the LoRA gradients."""
    model = MODELS[inputs.model]
    measured, extrapolated = learner_tokens_per_second(model)
    tok_s = inputs.learner_tok_s or measured
    tokens = shape.rules.groups_per_step * shape.group_size * (shape.prompt_tokens + shape.completion_tokens)
    ring = 2.0 * (ranks - 1) / ranks * lora_gradient_bytes(model) / (inputs.link_gbps * 1e9 / 8)
    return tokens / tok_s / ranks + ring, extrapolated and inputs.learner_tok_s is None


def check_seconds(inputs: PlanInputs, shape: PlanShape) -> float:
    """The check's forward of one group at an older version, on one rank: a share of one group's part of a
    one-rank step (a group at the step's own version is checked for nothing)."""
    if not inputs.logprob_check:
        return 0.0
    one_rank, _ = step_seconds(inputs, replace(shape, rules=replace(shape.rules, groups_per_step=1)), 1)
    return inputs.check_forward_share * one_rank


def plan(inputs: PlanInputs, shape: PlanShape, actor_counts: list[int], rank_counts: list[int],
         steps: int = 120) -> Plan:
    """Steps/s for every (ranks, actors) pair, and where each rank count stops gaining from more actors."""
    per_group = actor_seconds_per_group(inputs, shape)
    fetch = lora_gradient_bytes(MODELS[inputs.model]) / 2 / (inputs.link_gbps * 1e9 / 8)  # fp16-sized weights
    rows, seconds, saturating = [], {}, {}
    extrapolated, check = False, check_seconds(inputs, shape)
    for ranks in rank_counts:
        seconds[ranks], extrapolated = step_seconds(inputs, shape, ranks)
        verify = CheckSpec(enabled=inputs.logprob_check, forward_seconds=check, share=inputs.check_share,
                           completions=completions_share(inputs.check_completions, shape.group_size))
        run = RunSpec(rules=shape.rules, step_seconds=seconds[ranks], ranks=ranks, check=verify, steps=steps)
        for count in actor_counts:
            result = simulate([ActorSpec(per_group, fetch)] * count, run)
            rows.append(PlanRow(ranks, count, result.steps_per_second, result.learner_busy_fraction,
                                result.actor_busy_fraction, result.forward_fraction, result.check_seconds_per_step))
        best = max(r.steps_per_second for r in rows if r.ranks == ranks)
        saturating[ranks] = min(r.actors for r in rows if r.ranks == ranks and r.steps_per_second >= SATURATED * best)
    return Plan(rows, seconds, check, per_group, saturating, extrapolated)


def render(result: Plan, inputs: PlanInputs, shape: PlanShape) -> str:
    """The plan as a plain-text table with its assumptions."""
    ranks = sorted(result.step_seconds)
    lines = [
        f"{inputs.model} on {inputs.mac} actors ({result.actor_seconds_per_group:.1f} s a group of "
        f"{shape.group_size} x {shape.completion_tokens} tokens), {shape.rules.groups_per_step} groups a step",
        "learner step: " + ", ".join(f"{r} rank{'s' if r > 1 else ''} {result.step_seconds[r]:.0f} s" for r in ranks)
        + (" (extrapolated by parameter count)" if result.learner_extrapolated else "")
        + (f"; logprob check: free at the step's version, {result.check_seconds:.1f} s a whole group at an older one "
           f"on one rank when drawn (probation, then {inputs.check_share:.0%}; {inputs.check_completions or 'all'} of "
           f"{shape.group_size} completions), each rank its own rows, in the step"
           if inputs.logprob_check else "; no logprob check (trusted actors)"),
        "actors | " + " | ".join(f"steps/h, {r} rank{'s' if r > 1 else ''}" for r in ranks),
    ]
    for count in sorted({row.actors for row in result.rows}):
        cells = [next(x for x in result.rows if x.actors == count and x.ranks == r) for r in ranks]
        lines.append(f"{count:>6} | " + " | ".join(f"{3600 * c.steps_per_second:>14.1f}" for c in cells))
    lines.append("one learner saturates at: " + ", ".join(
        f"{result.saturating_actors[r]} actors ({r} rank{'s' if r > 1 else ''})" for r in ranks))
    lines.append("A model, not a measurement: see docs/simulator.md.")
    return "\n".join(lines)


def render_on_off(checked: Plan, trusted: Plan) -> str:
    """Steps/h with verification on and off side by side, by actors and ranks, as a Markdown table."""
    ranks = sorted(checked.step_seconds)
    lines = ["| Macs of actors | " + " | ".join(f"{r} rank{'s' if r > 1 else ''}: on / off" for r in ranks) + " |",
             "|---|" + "---|" * len(ranks)]
    for count in sorted({row.actors for row in checked.rows}):
        cells = []
        for r in ranks:
            on, off = (next(x for x in p.rows if x.actors == count and x.ranks == r) for p in (checked, trusted))
            cells.append(f"{3600 * on.steps_per_second:.0f} / {3600 * off.steps_per_second:.0f}")
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    lines.append("| one learner saturates at | " + " | ".join(
        f"{checked.saturating_actors[r]} / {trusted.saturating_actors[r]} Macs" for r in ranks) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class LengthsRow:
    """One fleet at drawn lengths: its actor count, whether rows are refilled, and what the simulation says."""

    actors: int
    refill: bool
    result: SimResult


def plan_lengths(inputs: PlanInputs, shape: PlanShape, actor_counts: list[int], ranks: int = 1,
                 steps: int = 120) -> list[LengthsRow]:
    """Each actor count at `shape.lengths`, with and without refilled rows. The step costs its real tokens (and
    `inputs.padding` of its padding) at one rank's tokens/s over `ranks`, plus the ring all-reduce; the check's
    forward is that of a group of mean length."""
    lengths = shape.lengths or LengthSpec("fixed", shape.completion_tokens)
    model = MODELS[inputs.model]
    mean_shape = replace(shape, completion_tokens=max(1, round(lengths.mean())))
    ring, _ = step_seconds(inputs, replace(mean_shape, prompt_tokens=0, completion_tokens=0), ranks)
    tok_s = inputs.learner_tok_s or learner_tokens_per_second(model)[0]
    verify = CheckSpec(enabled=inputs.logprob_check, forward_seconds=check_seconds(inputs, mean_shape),
                       share=inputs.check_share, completions=completions_share(inputs.check_completions, shape.group_size))
    run = RunSpec(rules=shape.rules, step_seconds=ring, ranks=ranks, check=verify, steps=steps,
                  seconds_per_token=1.0 / (tok_s * ranks), prompt_tokens=shape.prompt_tokens, padding=inputs.padding)
    fetch = lora_gradient_bytes(model) / 2 / (inputs.link_gbps * 1e9 / 8)
    rows = []
    for count in actor_counts:
        for refill in (True, False):
            actor = ActorSpec(0.0, fetch, lengths=lengths, token_seconds=1.0 / (model.decode_tok_s[inputs.mac]
                              * inputs.batch_speedup), group_size=shape.group_size, refill=refill)
            rows.append(LengthsRow(count, refill, simulate([actor] * count, run)))
    return rows


def render_lengths(rows: list[LengthsRow], inputs: PlanInputs, shape: PlanShape, ranks: int = 1) -> str:
    """The plan at drawn lengths as a Markdown table, each cell refilled rows / not."""
    lengths = shape.lengths or LengthSpec("fixed", shape.completion_tokens)
    tok_s = inputs.learner_tok_s or learner_tokens_per_second(MODELS[inputs.model])[0]
    head = (f"{inputs.model}, actors on {inputs.mac} (batch speedup {inputs.batch_speedup:g}), {lengths.describe()} "
            f"(mean {lengths.mean():.0f}), {shape.prompt_tokens}-token prompts, {shape.rules.groups_per_step} groups x "
            f"{shape.group_size} a step; learner {tok_s:g} tok/s a rank, {ranks} rank{'s' if ranks > 1 else ''}, "
            f"paying {inputs.padding:.0%} of its padding. Each cell: refilled rows / not.")
    lines = [head, "", "| Macs of actors | s a step | rollout tok/s | learner busy | versions behind, mean | p90 "
             "| idle decode rows | stale, refused |", "|---|---|---|---|---|---|---|---|"]
    for count in sorted({row.actors for row in rows}):
        on, off = (next(r.result for r in rows if r.actors == count and r.refill is refill) for refill in (True, False))
        cells = [f"{1 / on.steps_per_second:.0f} / {1 / off.steps_per_second:.0f}" if on.steps_per_second
                 and off.steps_per_second else "- / -"]
        cells += [f"{on.rollout_tokens_per_second:.0f} / {off.rollout_tokens_per_second:.0f}",
                  f"{on.learner_busy_fraction:.0%} / {off.learner_busy_fraction:.0%}",
                  f"{on.mean_staleness:.2f} / {off.mean_staleness:.2f}",
                  f"{on.staleness_p90:.0f} / {off.staleness_p90:.0f}",
                  f"{on.idle_slot_fraction:.0%} / {off.idle_slot_fraction:.0%}",
                  f"{on.stale_fraction:.0%} / {off.stale_fraction:.0%}"]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
