"""A data-parallel learner rank other than 0: no sockets but MLX's and rank 0's doorbell, no run directory.

It waits for rank 0's run config, loads the same model (the same path, as an
actor does), takes rank 0's weights and optimizer state, and then trains its
rows of each batch rank 0 broadcasts, until rank 0 says stop. SIGTERM and
SIGINT are left to rank 0: it checkpoints, then tells this rank to stop.
"""

from __future__ import annotations

import importlib
import json
import logging
import signal
import time
from typing import Any

from grpo_fleet.config import RunConfig
from grpo_fleet.learner.ranks.collectives import RankGroup
from grpo_fleet.learner.ranks.distributed import DataParallel, share_state, state_layout
from grpo_fleet.learner.ranks.rank_metrics import FollowerMetrics, follower_metrics, serve_follower_metrics
from grpo_fleet.learner.ranks.ring_guard import check_state, enter_ring, receive_signed
from grpo_fleet.learner.ranks.ring_trust import RingRefused
from grpo_fleet.learner.ranks.sharding import Command
from grpo_fleet.learner.step.trainer import Trainer, load_trainer
from grpo_fleet.models.loading import model_digest
from grpo_fleet.protocol.doorbell import BellListener
from grpo_fleet.protocol.logsafe import shown
from grpo_fleet.runtime.exit_codes import DONE, REFUSED
from grpo_fleet.runtime.trees import flat_leaves

log = logging.getLogger("grpo_fleet.learner.ranks")
IDLE_SLEEP_SHARE = 0.8  # of distributed.keepalive_seconds, slept after each keepalive


class SetupRefused(RuntimeError):
    """This rank cannot join rank 0's run (a different model, or rank 0 refused to start)."""


def join_run(ranks: RankGroup) -> tuple[RunConfig, Trainer]:
    """Rank 0's run config, the model loaded and checked, and rank 0's weights and optimizer state."""
    with ranks.announced():  # asleep while rank 0 loads the model, calibrates and resumes
        setup: dict[str, Any] = json.loads(receive_signed(ranks, "run config"))
    if "refused" in setup:
        raise SetupRefused(f"rank 0 did not start: {setup['refused']}")
    cfg = RunConfig.model_validate(setup["config"])
    ranks.cfg = cfg.distributed  # rank 0's bounds from here on
    path = setup["model_path"]
    trainer = load_trainer(cfg, path)  # the Trainer rank 0 built: same model, objective, optimizer
    layout = state_layout(trainer)
    if model_digest(path) != setup["model_digest"] or _names(layout) != _names(setup["layout"]):
        # Rank 0 waits in share_state for this rank; exiting makes it fail there, naming this rank.
        raise SetupRefused(f"the model at {path} differs from rank 0's (digest or trainable weights): "
                           "every rank needs the same model files")
    share_state(ranks, trainer, setup["layout"])
    check_state(ranks, trainer.policy.model.trainable_parameters(), trainer.optimizer.state)
    ranks.check_identical(trainer.policy.model.trainable_parameters(), 0)
    return cfg, trainer


def join_doorbell(ranks: RankGroup) -> None:
    """Subscribe to rank 0's doorbell (distributed.share_doorbell), if it has one."""
    try:
        where = json.loads(receive_signed(ranks, "doorbell"))
    except ValueError:
        raise SetupRefused("rank 0's doorbell message is not JSON") from None
    if where is None:
        return
    heartbeat = where.get("heartbeat") if isinstance(where, dict) else None
    if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool) or not 0 < heartbeat <= 3600:
        raise SetupRefused(f"rank 0's doorbell {shown(str(where))} names no heartbeat of 0 to 3600 s")
    try:
        ranks.listener = BellListener(where.get("endpoint"), float(heartbeat))
    except ValueError as exc:
        raise SetupRefused(str(exc)) from None


def _names(layout: dict[str, Any]) -> list[list[str]]:
    # Sorted: a resumed optimizer state comes back from its file in another order; arrays travel by name.
    return [sorted(entry[0] for entry in layout[part]) for part in ("weights", "optimizer")]


def run_follower(ranks: RankGroup) -> int:
    """Train rank 0's batches until it says stop; the exit status (collective failures exit on their own)."""
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: log.info("rank %d: stop signal ignored; rank 0 says when", ranks.rank))
    try:
        enter_ring(ranks)  # rank 0 authenticated (with keys) and every rank's proof checked, before anything is shared
        join_doorbell(ranks)
        # mlx-lm's import (over a CPU second, most of it transformers) now, while rank 0 loads the model and
        # calibrates: after the run config it would keep rank 0 spinning in share_state for this rank's load.
        importlib.import_module("mlx_lm")
        cfg, trainer = join_run(ranks)
    except SetupRefused as exc:
        log.error("rank %d: %s", ranks.rank, exc)
        return REFUSED
    except RingRefused as exc:
        log.error("%s", exc)
        return REFUSED
    sharding = DataParallel(ranks, cfg.distributed.digest_every)
    trainer.sharding = sharding
    metrics = follower_metrics(ranks)
    server = serve_follower_metrics(metrics, cfg.metrics, ranks.rank)
    log.info("rank %d of %d ready: %s, waiting for rank 0's batches", ranks.rank, ranks.size, trainer.policy.path)
    try:
        return _follow(sharding, trainer, metrics, cfg.distributed.keepalive_seconds)
    except RingRefused as exc:  # a step header or batch failed its HMAC: train nothing of it
        log.error("%s; exiting without training on it", exc)
        return REFUSED
    finally:
        if server is not None:
            server.close()


def _follow(sharding: DataParallel, trainer: Trainer, metrics: FollowerMetrics, keepalive_seconds: float) -> int:
    rank = sharding.ranks.rank
    while True:
        header = sharding.receive()
        if header.command == Command.STOP:
            log.info("rank %d: rank 0 says stop after %d steps", rank, sharding.steps)
            return DONE
        if header.command == Command.STEP:
            started = time.perf_counter()
            # This rank's trainable weights shape those of the versions its rows of older groups are checked at.
            batch = sharding.receive_batch(header, flat_leaves(trainer.policy.model.trainable_parameters()))
            metrics.observe_step(started, trainer.step(batch).recomputed_rows)
        elif header.command == Command.KEEPALIVE and sharding.ranks.listener is None:
            # Rank 0 is idle and will not be back for about keepalive_seconds. MLX's ring spins a core while
            # it waits in a collective, so sleep most of that away (the first step after idling waits for it).
            # With rank 0's doorbell, `sharding.receive` sleeps until rank 0 sends instead.
            time.sleep(IDLE_SLEEP_SHARE * keepalive_seconds)
