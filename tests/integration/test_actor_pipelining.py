"""A real actor pipelines its requests: the next lease is asked for before the current one is submitted,
and while several leases decode together in its rolling batch."""

from __future__ import annotations

import threading
from pathlib import Path

from grpo_fleet.learner.door.server import LearnerServer
from grpo_fleet.learner.run.build import build_learner


def test_actor_asks_for_its_next_lease_while_generating_the_current_one(run_config, spawn):
    _, cfg = run_config(train={"steps": 6, "checkpoint_every": 100})
    learner = build_learner(cfg)
    requests: list[str] = []
    handle = learner.requests.handle  # what the server's loop calls

    def recording(identity, msg, *args, **kwargs):
        if type(msg).__name__ != "Rollouts":  # a Rollouts is recorded when it arrives, below
            requests.append(type(msg).__name__)
        return handle(identity, msg, *args, **kwargs)

    learner.requests.handle = recording  # type: ignore[method-assign]
    server = LearnerServer(learner)
    # Rollouts are verified on their own thread and handled when the verdict is in, so their order among the
    # handled requests is not their order of arrival: record each as the I/O thread hands it to the verifier.
    assert server.dispatch.verifier is not None
    submit = server.dispatch.verifier.submit

    def arriving(*args, **kwargs):
        requests.append("Rollouts")
        return submit(*args, **kwargs)

    server.dispatch.verifier.submit = arriving
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    actor = spawn("actor", "--connect", cfg.server.bind, "--model-dir", str(Path(cfg.run_dir)), name="actor")
    serving.join(timeout=180)
    assert not serving.is_alive(), "the run did not finish"
    assert actor.wait(timeout=30) == 0, actor.log_path.read_text()[-3000:]

    work = [name for name in requests if name in ("LeaseRequest", "Rollouts")]
    assert work.count("Rollouts") >= 6
    # Serial would be L R L R ...; pipelined, a second LeaseRequest comes before the first Rollouts, and every
    # Rollouts finds its actor already asking for more than it has delivered: the next lease was asked for
    # as soon as the last one went into the batch, not after a submission. (Whether a third is asked for before
    # the first submission depends on whether the second lease went in before the first finished: timing, which
    # a fresh clone's run on busy cores did not meet, so it is not asserted.)
    first = work.index("Rollouts")
    assert work[:first].count("LeaseRequest") >= 2, work[:12]
    assert all(work[:i].count("LeaseRequest") > work[: i + 1].count("Rollouts")
               for i, name in enumerate(work) if name == "Rollouts"), work[:24]
