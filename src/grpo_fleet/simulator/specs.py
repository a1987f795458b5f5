"""What a simulated run is made of: the fleet's rules, the check, the actors, the learner, and the host.

`FleetRules` is declared once and shared by a simulated run (`RunSpec`) and a
planned one (`plan.PlanShape`): the learner's own leasing and staleness rules,
read from a RunConfig by `FleetRules.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from grpo_fleet.config import RunConfig, SecurityConfig
from grpo_fleet.simulator.lengths import LengthSpec

_SECURITY = SecurityConfig()


@dataclass(frozen=True)
class FleetRules:
    """The rules the learner runs its fleet by; the defaults are RunConfig's."""

    groups_per_step: int = 8  # grpo.groups_per_step
    max_staleness: int = 2  # grpo.max_staleness: older groups are rejected at intake
    in_flight_steps: int = 2  # server.in_flight_steps: leased-out plus buffered groups, in steps
    max_groups_per_lease: int = 4  # server.max_groups_per_lease
    lease_seconds: float = 60.0  # server.lease_seconds

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "FleetRules":
        return cls(groups_per_step=cfg.grpo.groups_per_step, max_staleness=cfg.grpo.max_staleness,
                   in_flight_steps=cfg.server.in_flight_steps, max_groups_per_lease=cfg.server.max_groups_per_lease,
                   lease_seconds=cfg.server.lease_seconds)


@dataclass(frozen=True)
class CheckSpec:
    """The learner's logprob check (security.*), as the step runs it.

    A group sampled at the version the step trains from is checked inside the
    step's own forward: free. An older group needs a forward pass at its own
    version, and gets one only when drawn: every group of an actor on probation
    (its first `probation_groups` checked groups), then a random `share`. Such a
    forward recomputes `completions` of the group's completions (a share of its
    G): `forward_seconds x completions x drawn` on one rank. With `spread`
    (LoRA, learner/step/recheck.py) each rank recomputes its own rows of them
    inside the step, so N ranks share that about evenly; without it (full
    fine-tuning) rank 0 recomputes them all before the step.
    """

    enabled: bool = True  # security.verify_logprobs
    forward_seconds: float = 0.0  # one older group's forward at its own version (all G completions), on one rank
    completions: float = 1.0  # the share of a group's completions such a forward recomputes (check_completions / G)
    probation_groups: int = _SECURITY.probation_groups
    share: float = _SECURITY.check_share
    spread: bool = True  # each data-parallel rank recomputes its own rows (LoRA); False: all on rank 0
    seed: int = 0  # the draw is the learner's own Trust, seeded here so a simulation repeats

    @classmethod
    def from_config(cls, cfg: RunConfig, forward_seconds: float) -> "CheckSpec":
        security = cfg.security
        return cls(enabled=security.verify_logprobs, forward_seconds=forward_seconds,
                   completions=completions_share(security.check_completions, cfg.generation.group_size),
                   probation_groups=security.probation_groups, share=security.check_share,
                   spread=cfg.lora.enabled)


def completions_share(check_completions: int, group_size: int) -> float:
    """The share of a group's G completions a forward check recomputes (security.check_completions; 0: all)."""
    return 1.0 if check_completions == 0 else min(1.0, check_completions / group_size)


TRUSTED = CheckSpec(enabled=False)


@dataclass(frozen=True)
class ActorSpec:
    """One simulated actor: a lease of n groups takes `lease_seconds + n x seconds_per_group` (its groups are
    decoded as one batch, so a lease has a part its size hardly changes), plus `fetch_seconds` for a new version.

    Given `lengths`, each completion's length is drawn instead, and the lease's batch of n x G rows decodes
    as `simulator.decoding` says: until its longest completion ends, or, with `refill`, handing rows that end
    early to the next lease. `seconds_per_group` is then unused.
    """

    seconds_per_group: float
    fetch_seconds: float = 0.0
    max_groups: int = 2  # ActorConfig.max_groups: what it asks for per lease
    lease_seconds: float = 0.0
    lengths: Optional[LengthSpec] = None  # None: every group costs seconds_per_group, and has no lengths
    token_seconds: float = 0.0  # with lengths: 1 / the batch's decode tokens/s, all rows decoding
    group_size: int = 8  # generation.group_size: a group's completions (rows)
    refill: bool = False  # a row that ends takes the next lease's work at once (continuous batching)


@dataclass(frozen=True)
class RunSpec:
    """The run's rules and the learner's side."""

    rules: FleetRules = field(default_factory=FleetRules)
    step_seconds: float = 1.0  # the learner's step at `ranks` ranks, all-reduce included, checks not
    ranks: int = 1
    informative_fraction: float = 1.0  # groups with reward variance (the rest are skipped, not trained)
    # The learner's work per submitted group besides training (grpo_fleet_learner_rollouts_answer_seconds:
    # rewards re-scored). One verifier thread does it, on the device the steps use, so a step under way is
    # delayed by as much.
    answer_seconds_per_group: float = 0.0
    check: CheckSpec = TRUSTED
    steps: int = 200
    # Steps/s is measured from the end of this step to the last (None: the second half, a steady state). A
    # measured run of a few steps is compared from its second step on (its first carries the start-up).
    measure_from: Optional[int] = None
    # The learner's step at drawn lengths (actors with a LengthSpec): step_seconds plus this much per trained
    # token, prompt and completion, at `ranks` ranks. Rows are padded to the batch's longest completion, of which
    # the step pays `padding` (0: packed rows, no padding paid; 1: every row padded).
    seconds_per_token: float = 0.0
    prompt_tokens: int = 0
    padding: float = 0.0
    length_seed: int = 0  # the actors' length draws (each actor its own stream), so a simulation repeats


@dataclass(frozen=True)
class SharedHost:
    """All processes on one machine of `cores` cores. `learner_cores` and `actor_cores` are what each keeps
    busy when it runs alone (CPU seconds over wall seconds); the seconds in ActorSpec and RunSpec are then
    its alone-speeds."""

    cores: float
    learner_cores: float
    actor_cores: float


@dataclass(frozen=True)
class SimResult:
    """Figures over the measured steps (RunSpec.measure_from)."""

    steps_per_second: float
    learner_busy_fraction: float
    actor_busy_fraction: float
    stale_fraction: float
    mean_staleness: float
    fused_fraction: float = 0.0  # trained groups checked inside the step's own forward (at its version)
    forward_fraction: float = 0.0  # trained groups recomputed at an older version (probation or drawn)
    check_seconds_per_step: float = 0.0  # the forwards' seconds a step, on the slowest rank
    # Versions behind: p90 of the trained groups' (mean_staleness is their mean), and the mean on arrival at
    # the learner, before the buffer's wait.
    staleness_p90: float = 0.0
    arrival_staleness: float = 0.0
    idle_slot_fraction: float = 0.0  # actors' decoding row-seconds with nothing to decode (drawn lengths only)
    rollout_tokens_per_second: float = 0.0  # completion tokens the fleet submitted, over the measured steps
