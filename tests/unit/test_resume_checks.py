"""After a full fine-tuning resume, groups restored from the checkpoint's buffer (issue 39, item 7), on a real tiny
learner; no sockets.

Only LoRA saves its versions' weights with a checkpoint. Under full fine-tuning
a resumed learner holds the weights of its current version only, so a restored
group of an older version could be neither recomputed nor screened: it must not
train unchecked (`version_gone` in the plan), but go back to be sampled again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from test_learner_core import ACTOR_A, ask, generated_rollouts, hello, lease
from test_verification import rejections, resumed_from, shifted

from grpo_fleet.learner.run.coordinator import RunCoordinator
from grpo_fleet.protocol.reasons import RejectReason
from helpers import audit_ledger


def test_restored_groups_of_a_version_a_full_fine_tuning_resume_lost_are_resampled_not_trained(
        make: Callable[..., RunCoordinator]) -> None:
    first = make(security={"verify_logprobs": True, "probation_groups": 1000}, lora={"enabled": False},
                 grpo={"beta": 0.0, "max_staleness": 2})
    hello(first)
    assert ask(first, ACTOR_A, generated_rollouts(first, lease(first))).status == "accepted"
    assert first.train_step() is not None and first.state.version == 1
    honest = generated_rollouts(first, lease(first))
    lie = shifted(generated_rollouts(first, lease(first)), -0.3)  # sampled at v1, lying
    assert ask(first, ACTOR_A, honest).status == "accepted" and ask(first, ACTOR_A, lie).status == "accepted"
    assert first.train_step() is not None and first.state.version == 2, "the honest v1 groups trained"
    restored = {g.group_id for g in first.state.buffer}
    assert restored == {g.group_id for g in lie.groups}
    first.checkpoint()
    with resumed_from(first) as resumed:
        assert {g.group_id for g in resumed.state.buffer} == restored
        hello(resumed)
        assert ask(resumed, ACTOR_A, generated_rollouts(resumed, lease(resumed))).status == "accepted"  # v2
        queued = len(resumed.state.scheduler.queue.tickets)
        assert resumed.train_step() is not None, "the new v2 groups train"
        unchecked = resumed.metrics.registry.get_sample_value("grpo_fleet_learner_groups_unchecked_total",
                                                              {"reason": "version_gone"}) or 0.0
        assert unchecked == 0, "nothing trained for want of its version's weights"
        assert rejections(resumed, RejectReason.VERSION_GONE) == len(restored)
        assert len(resumed.state.scheduler.queue.tickets) == queued + len(restored), "their prompts go back"
        resumed.runlog.sizes()  # flushes
        audit = audit_ledger(Path(resumed.cfg.run_dir) / "ledger.jsonl")
        assert {g for g, d in audit.dropped.items() if d["reason"] == "version_gone"} == restored
