"""The logprob check on the steps between two publishes (train.sync_every > 1; issue 39, item 14), on a real tiny
learner; no sockets.

Between publishes the live weights are already a few updates past the version
the actors sample, so the step's own forward cannot check those groups exactly.
It still screens them, as it screens older groups, and a group beyond the
screen is recomputed at its version.
"""

from __future__ import annotations

from typing import Callable

from test_learner_core import ACTOR_A, GROUPS_PER_STEP, ask, generated_rollouts, hello, lease
from test_verification import checks, rejections, spiked

from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.protocol.reasons import RejectReason


def test_a_spike_at_the_steps_own_version_between_publishes_is_caught_by_the_screen(
        make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True, "probation_groups": 0, "check_share": 1e-9},
                   grpo={"max_staleness": 2}, train={"sync_every": 2})
    hello(learner)
    liar = spiked(generated_rollouts(learner, lease(learner)), -20.0)  # sampled at v0
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert learner.train_step() is not None
    assert learner.state.version == 0 and not learner.state.weights_published, "step 1 of 2: nothing published"
    assert ask(learner, ACTOR_A, liar).status == "accepted"
    assert not any(g.check_logprobs for g in learner.state.buffer), "sampled out: no forward check"
    assert learner.train_step() is None and learner.state.step == 1, "nothing of it trained"
    assert learner.registry.is_banned(next(iter(learner.registry.actors.values())).principal)
    assert rejections(learner, RejectReason.LOGPROB_MISMATCH) == GROUPS_PER_STEP
    assert checks(learner, "screen", "failed") == 1


def test_honest_groups_between_publishes_pass_the_screen_and_train(make: Callable[..., RunCoordinator]) -> None:
    learner = make(security={"verify_logprobs": True, "probation_groups": 0, "check_share": 1e-9},
                   grpo={"max_staleness": 2}, train={"sync_every": 2})
    hello(learner)
    early = generated_rollouts(learner, lease(learner))
    assert ask(learner, ACTOR_A, generated_rollouts(learner, lease(learner))).status == "accepted"
    assert learner.train_step() is not None and not learner.state.weights_published
    assert ask(learner, ACTOR_A, early).status == "accepted"
    assert learner.train_step() is not None and learner.state.version == 1
    assert checks(learner, "screen", "passed") == GROUPS_PER_STEP and checks(learner, "screen", "failed") == 0
