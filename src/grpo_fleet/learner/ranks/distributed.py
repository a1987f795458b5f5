"""The data-parallel learner: N ranks over `mx.distributed`, rank 0 serving the fleet.

Each step rank 0 broadcasts the TrainBatch; every rank trains its rows
(`sharding.shard_rows`) in micro-batches, normalised by the whole batch's
totals, so the all-sum of the ranks' loss, stats and gradients equals the
one-process value. Every rank then applies the same clip and AdamW update, and
every `distributed.digest_every` steps the ranks check that their weights are
bitwise identical. The other ranks' side is learner/ranks/follower.py.

One process (no `mlx.launch`, or a group of one) never gets here: its Trainer
keeps `SingleProcess` sharding and runs no collective at all.

This module starts and ends the run across the ranks; the step's own side, `DataParallel`, is data_parallel.py.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
from prometheus_client import CollectorRegistry

from grpo_fleet.config import ConfigError, DistributedConfig, RunConfig
from grpo_fleet.learner.ranks.collectives import RankGroup, init_group
from grpo_fleet.learner.ranks.data_parallel import DataParallel
from grpo_fleet.learner.ranks.rank_metrics import CollectiveTotals
from grpo_fleet.learner.ranks.ring_guard import (
    admit_ranks,
    check_backend,
    check_network,
    check_state,
    rank0_host,
    send_signed,
)
from grpo_fleet.learner.ranks.sharding import Command, Header, check_rows_cover_ranks
from grpo_fleet.learner.step.trainer import Trainer
from grpo_fleet.protocol.doorbell import open_bell
from grpo_fleet.runtime.trees import flat_leaves

log = logging.getLogger("grpo_fleet.learner.ranks")


def state_layout(trainer: Trainer) -> dict[str, list[tuple[str, list[int], str]]]:
    """(name, shape, dtype) of every trainable weight and optimizer array, in the order they are broadcast."""

    def layout(tree: Any) -> list[tuple[str, list[int], str]]:
        return [(name, list(value.shape), str(value.dtype).rsplit(".", 1)[-1])
                for name, value in flat_leaves(tree) if isinstance(value, mx.array)]

    return {"weights": layout(trainer.policy.model.trainable_parameters()), "optimizer": layout(trainer.optimizer.state)}


def share_state(ranks: RankGroup, trainer: Trainer, layout: dict[str, list[tuple[str, list[int], str]]]) -> None:
    """Rank 0's trainable weights and optimizer state (moments and step) on every rank, bitwise.

    So the other ranks need no run directory and no checkpoint: a run resumes
    from rank 0's checkpoint with any number of ranks.
    """
    for part in ("weights", "optimizer"):
        templates = [mx.zeros(shape, dtype=getattr(mx, dtype)) for _, shape, dtype in layout[part]]
        if ranks.rank == 0:
            tree = trainer.policy.model.trainable_parameters() if part == "weights" else trainer.optimizer.state
            templates = [value for _, value in flat_leaves(tree) if isinstance(value, mx.array)]
        # idle: the others may still be loading their model.
        values = ranks.broadcast(templates, f"rank 0's {part}", idle=True)
        if ranks.rank == 0:
            continue
        pairs = [(name, value) for (name, _, _), value in zip(layout[part], values)]
        if part == "weights":
            trainer.policy.model.load_weights(pairs, strict=False)
            mx.eval(trainer.policy.model.parameters())
        else:
            from mlx.utils import tree_unflatten

            trainer.set_optimizer_state(tree_unflatten(pairs))


def setup_message(cfg: RunConfig, trainer: Trainer, model_digest: str) -> dict[str, Any]:
    """What rank 0 tells the others before the first step: the run config, the model, the state's layout."""
    return {"config": cfg.model_dump(mode="json"), "model_path": trainer.policy.path, "model_digest": model_digest,
            "layout": state_layout(trainer)}


def share_doorbell(ranks: RankGroup, cfg: DistributedConfig) -> None:
    """Rank 0, as soon as the ring is proven: open its doorbell and tell the others where it rings (null off the
    ring backend), before the minutes it may take to load the model, calibrate and resume."""
    ranks.bell = open_bell(rank0_host(cfg), cfg.keepalive_seconds)
    where = None if ranks.bell is None else {"endpoint": ranks.bell.endpoint, "heartbeat": cfg.keepalive_seconds}
    send_signed(ranks, json.dumps(where).encode(), "doorbell")


def close_doorbell(ranks: RankGroup) -> None:
    if ranks.bell is not None:
        ranks.bell.close()
        ranks.bell = None


def start_rank0(ranks: RankGroup, cfg: RunConfig, trainer: Trainer, model_digest: str, step: int) -> None:
    """Rank 0, its learner built (and resumed): hand the others the run and the state, then shard every step."""
    setup = setup_message(cfg, trainer, model_digest)
    with ranks.announced():
        send_signed(ranks, json.dumps(setup).encode(), "run config")
    share_state(ranks, trainer, setup["layout"])
    check_state(ranks, trainer.policy.model.trainable_parameters(), trainer.optimizer.state)
    ranks.check_identical(trainer.policy.model.trainable_parameters(), step)
    trainer.sharding = DataParallel(ranks, cfg.distributed.digest_every)
    log.info("data-parallel learner: %d ranks, %s per step each", ranks.size, "about 1/%d of the rows" % ranks.size)


def refuse_others(ranks: RankGroup, reason: str) -> None:
    """Rank 0 could not start (bad config, no memory): tell the others, who are waiting for the run config."""
    with ranks.announced():
        send_signed(ranks, json.dumps({"refused": reason}).encode(), "run config")


def stop_others(ranks: RankGroup) -> None:
    """The run is over, or rank 0 was stopped and has checkpointed: the others exit 0."""
    DataParallel(ranks, 1).send(Header(Command.STOP))
    log.info("told the other %d ranks to stop", ranks.size - 1)


def check_batch_fits(cfg: RunConfig, size: int) -> None:
    """Every step's batch must have a row for each rank (a ConfigError, which the CLI prints and exits 2 on)."""
    try:
        check_rows_cover_ranks(cfg.grpo.groups_per_step * cfg.generation.group_size, size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def connect(cfg: DistributedConfig, rank: int, *, authenticated: bool) -> Optional[RankGroup]:
    """This launched process's ranks, connected; None in a group of one (the plain learner, no collectives).

    A ring on a network it cannot trust is refused first (RingRefused): `authenticated` says whether this rank
    has its keys (rank 0's security.keys_dir, or another rank's distributed.key_file and learner_key_file).
    """
    check_network(cfg, authenticated=authenticated)
    group = init_group(cfg, rank)
    if group.size() == 1:
        return None
    check_backend(cfg)
    return RankGroup(group, cfg)


@contextmanager
def rank0_session(ranks: RankGroup, cfg: RunConfig) -> Iterator[Callable[[Trainer, str, int, CollectorRegistry], None]]:
    """Around rank 0's learner: yields `start(trainer, model_digest, step, metrics_registry)`, which shares the
    run (rank 0's trainer, its model's digest, the step it continues from) and turns sharding on.

    First every rank proves it belongs to the run (ring_guard.py). Then, whatever happens, the other ranks hear how
    it ended: refused before the
    start (a bad config, no memory), or stop after it (the run is over, or
    rank 0 was stopped and has written its checkpoint).
    """
    started = False
    admit_ranks(ranks, cfg)  # before anything of the run is shared; a refusal (RingRefused) tells the others nothing
    share_doorbell(ranks, cfg.distributed)

    def start(trainer: Trainer, model_digest: str, step: int, metrics_registry: CollectorRegistry) -> None:
        nonlocal started
        start_rank0(ranks, cfg, trainer, model_digest, step)
        metrics_registry.register(CollectiveTotals(ranks))
        started = True

    try:
        check_batch_fits(cfg, ranks.size)
        yield start
    except BaseException as exc:
        if not started:
            refuse_others(ranks, f"{type(exc).__name__}: {exc}")
        else:
            stop_others(ranks)
        close_doorbell(ranks)
        raise
    if started:
        stop_others(ranks)
    else:
        refuse_others(ranks, "rank 0 did not start; see its log")
    close_doorbell(ranks)
