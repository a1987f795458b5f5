"""A logprob liar that comes back whenever its ban runs out (issue 39, item 4), on a real tiny learner; no sockets.

The liar is a sleeper: honest through its probation, then lying a little (under
the screen) in every group, each submitted one version late, so only a drawn
check can see it. It tries again every 10 minutes of a 2-hour run, on a clock
the test moves; its lies may train in its first life only.
"""

from __future__ import annotations

from itertools import cycle
from pathlib import Path
from typing import Callable

from test_learner_core import ACTOR_B, GROUPS_PER_STEP, ask, generated_rollouts, hello, lease
from test_verification import resumed_from, shifted

from grpo_fleet.learner.run.coordinator import RunCoordinator
from helpers import audit_ledger

LIAR = b"liar-identity"
LIAR_KEY = LIAR.hex()  # no CURVE: the key is the routing id
PROBATION = 2  # security.probation_groups: one honest submission of GROUPS_PER_STEP groups
ROUNDS = 12  # submissions a life tries before the liar gives up on it (a drawn check finds it long before)
SETTINGS = {"security": {"verify_logprobs": True, "probation_groups": PROBATION},
            "grpo": {"max_staleness": 2}, "train": {"steps": 10_000, "checkpoint_every": 10_000},
            # Leases as long as asked for, whatever speed a busy machine measures: the rounds are the same every run.
            "server": {"lease_seconds": 3600.0, "lease_target_seconds": 1800.0}}


def _round(learner: RunCoordinator, lie: bool) -> tuple[int, list[str]]:
    """The liar samples at version v; an honest actor's groups train the policy past v; then the liar submits (a
    version late) and the buffer is trained dry. Returns how many groups it sent, and the ids of those it lied in."""
    early = generated_rollouts(learner, lease(learner, LIAR))
    assert len(early.groups) == GROUPS_PER_STEP, "a full lease (SETTINGS): the draws fall the same way every run"
    version = learner.state.version
    _honest(learner)
    assert learner.state.version > version
    sent = shifted(early, -0.05) if lie else early
    assert ask(learner, LIAR, sent).status == "accepted"
    _honest(learner)
    return len(sent.groups), [g.group_id for g in sent.groups] if lie else []


def _honest(learner: RunCoordinator) -> None:
    """The honest actor's groups, at the current version, and every batch the buffer holds trained. Its Hello
    keeps it on probation (every group checked), so each draw of the check's share is the liar's."""
    hello(learner, ACTOR_B, "honest")
    assert ask(learner, ACTOR_B, generated_rollouts(learner, lease(learner, ACTOR_B))).status == "accepted"
    while learner.ready_to_train():
        learner.train_step()


def _life(learner: RunCoordinator) -> list[str]:
    """Hello, honest through probation, then lies until banned (or ROUNDS run out); the groups it lied in."""
    hello(learner, LIAR, "liar")
    lied: list[str] = []
    sent = 0
    for _ in range(ROUNDS):
        count, lies = _round(learner, lie=sent >= PROBATION)  # honest until its probation is passed
        sent, lied = sent + count, lied + lies
        if learner.registry.is_banned(LIAR_KEY):
            break
    return lied


class OneInFive:
    """Trust's draw at check_share 0.2, made exact: every fifth group after probation is checked, so a sleeper's
    first life trains (1 - p) / p = 4 lies, the mean of the OS's draw (learner/verify/trust.py)."""

    def __init__(self) -> None:
        self.values = cycle([0.9, 0.9, 0.9, 0.9, 0.1])

    def random(self) -> float:
        return next(self.values)


def _trained(learner: RunCoordinator, groups: list[str]) -> int:
    """How many of `groups` trained: a lying group trains only unchecked (a checked one fails and is dropped)."""
    learner.runlog.sizes()  # flushes
    audit = audit_ledger(Path(learner.cfg.run_dir) / "ledger.jsonl")
    return sum(group in audit.unchecked for group in groups)


def test_a_liar_returning_every_ten_minutes_for_two_hours_trains_at_most_four_groups_in_all(
        make: Callable[..., RunCoordinator], clock) -> None:
    learner = make(**SETTINGS)
    learner.registry.bans.clock = clock
    learner.verification.trust.draw = OneInFive()  # type: ignore[assignment]  # a Random's one method the check draws with
    lives: list[list[str]] = []
    for _ in range(12):  # an attempt every 10 minutes over 2 hours
        if not learner.registry.is_banned(LIAR_KEY):
            lives.append(_life(learner))
            assert learner.registry.is_banned(LIAR_KEY), "every life ends in a ban"
        clock.advance(600)
    trained = [_trained(learner, lied) for lied in lives]
    assert trained == [4, 0, 0, 0], "lies trained per life: the first life's share, never again"
    # Bans of 10, 20, 40 and 80 minutes: it came back 3 times, each caught at its first lie.
    assert len(lives) == 4 and learner.registry.bans.times_banned(LIAR_KEY) == 4
    assert all(0 < len(lied) <= GROUPS_PER_STEP for lied in lives[1:]), "caught at its first lying submission"
    assert not learner.registry.is_banned(ACTOR_B.hex())


def test_bans_and_ban_counts_survive_a_resume(make: Callable[..., RunCoordinator]) -> None:
    first = make(**SETTINGS)
    first.verification.trust.draw = OneInFive()  # type: ignore[assignment]  # caught within ROUNDS, whatever the OS draws
    lied = _life(first)
    assert lied and first.registry.is_banned(LIAR_KEY)
    first.checkpoint()
    with resumed_from(first) as resumed:
        bans = resumed.registry.bans
        assert bans.is_banned(LIAR_KEY) and bans.times_banned(LIAR_KEY) == 1
        assert resumed.metrics.registry.get_sample_value("grpo_fleet_learner_banned_peers") == 1
        bans.clock = lambda: float("inf")  # long after the ban ran out: its ban count still checks all it sends
        assert bans.record(LIAR_KEY) is True, "its last warning survived the resume"
