"""The data-parallel ranks prove they belong to the run (issue 29): a foreign process in a rank's place in MLX's
ring is refused before anything of the run is shared, a follower refuses a rank 0 it cannot authenticate, the
ring door admits only allowed keys, and with keys the ranks still train; a hung rank of three ends the others
cleanly and three ranks resume from rank 0's last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from grpo_fleet.learner.records.persistence import read_state
from grpo_fleet.models.loading import latest_checkpoint
from grpo_fleet.protocol.auth import add_actor, add_rank, init_keys
from grpo_fleet.protocol.ring_door import DoorClosed, knock, open_door
from grpo_fleet.runtime.exit_codes import RANKS_FAILED, REFUSED
from helpers import audit_ledger, finished_in_checkpoint, jsonl, wait_steps

INTRUDER = Path(__file__).parents[1] / "liars" / "ring_intruder.py"
SECRET = bytes(range(32))


def _hostfile(tmp_path: Path, free_port, ranks: int, name: str = "hosts.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
    return path


def _rank_env(hostfile: Path, rank: int) -> dict[str, str]:
    return {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}


def _keys(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A keys dir with one allowed rank key and one allowed actor key: (dir, rank secret, actor secret)."""
    keys = tmp_path / "keys"
    init_keys(keys)
    return keys, add_rank(keys, "rank1"), add_actor(keys, "actor0")


def _keyed_config(run_config, free_port, keys: Path, rank_key: Path, **sections):
    distributed = {"door_port": free_port(), "key_file": str(rank_key), "learner_key_file": str(keys / "learner.key"),
                   "idle_timeout_seconds": 20, **sections.pop("distributed", {})}
    return run_config(security={"keys_dir": str(keys)}, distributed=distributed, **sections)


def _log(proc) -> str:
    return proc.log_path.read_text()


def test_the_ring_door_admits_only_allowed_keys_and_counts_what_it_refuses(tmp_path, free_port):
    keys, rank_key, actor_key = _keys(tmp_path)
    stranger = tmp_path / "stranger"
    init_keys(stranger)  # a valid keypair the learner never allowed, and a learner key that is not ours
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    result: dict = {}
    door = threading.Thread(target=lambda: result.update(
        refusals=open_door(str(keys), endpoint, 2, SECRET, timeout_s=30)))
    door.start()
    learner_key = str(keys / "learner.key")
    with pytest.raises(DoorClosed, match="no rank 0 holding the secret half"):
        knock(endpoint, str(stranger / "learner.key_secret"), learner_key, 1, timeout_s=2)  # not allowed
    with pytest.raises(DoorClosed, match="no rank 0 holding the secret half"):
        knock(endpoint, str(actor_key), learner_key, 1, timeout_s=2)  # an actor's key is not a rank's
    with pytest.raises(DoorClosed, match="no rank 0 holding the secret half"):
        knock(endpoint, str(rank_key), str(stranger / "learner.key"), 1, timeout_s=2)  # a door we cannot trust
    with pytest.raises(DoorClosed, match="refused rank 7: malformed knock"):
        knock(endpoint, str(rank_key), learner_key, 7, timeout_s=5)
    assert knock(endpoint, str(rank_key), learner_key, 1, timeout_s=5) == SECRET
    door.join(timeout=10)
    assert result["refusals"] == Counter({"key not allowed": 2, "malformed knock": 1})


def test_a_foreign_process_in_a_followers_place_is_refused_at_the_door(run_config, spawn, tmp_path, free_port):
    keys, rank_key, _ = _keys(tmp_path)
    config, cfg = _keyed_config(run_config, free_port, keys, rank_key, distributed={"idle_timeout_seconds": 8})
    hostfile = _hostfile(tmp_path, free_port, 2)
    rank0 = spawn("learner", "--config", str(config), name="rank0", env=_rank_env(hostfile, 0))
    intruder = spawn("--knock", f"tcp://127.0.0.1:{cfg.distributed.door_port}", "--learner-key",
                     str(keys / "learner.key"), "120", script=INTRUDER, name="intruder", env=_rank_env(hostfile, 1))
    code = rank0.wait(timeout=120)
    log = _log(rank0)
    assert code == REFUSED, log[-3000:]
    assert "refused a CURVE handshake" in log, log[-3000:]
    refusal = [line for line in log.splitlines() if "refused the ring" in line]
    assert len(refusal) == 1 and "rank(s) 1 did not authenticate at the ring door" in refusal[0], log[-3000:]
    assert "learner ready" not in log and "run config" not in log, "nothing of the run was built or shared"
    assert jsonl(Path(cfg.run_dir) / "metrics.jsonl") == []
    assert "intruder: in the ring as rank 1 of 2" in _log(intruder)


def test_a_foreign_process_holding_a_followers_port_is_refused_by_the_ring_proof(run_config, spawn, tmp_path,
                                                                                   free_port):
    """The real follower's key comes through the door, but the ring's rank 1 is a process without the secret."""
    keys, rank_key, _ = _keys(tmp_path)
    config, cfg = _keyed_config(run_config, free_port, keys, rank_key)
    hostfile = _hostfile(tmp_path, free_port, 2)
    rank0 = spawn("learner", "--config", str(config), name="rank0", env=_rank_env(hostfile, 0))
    intruder = spawn("120", script=INTRUDER, name="intruder", env=_rank_env(hostfile, 1))
    endpoint = f"tcp://127.0.0.1:{cfg.distributed.door_port}"
    assert len(knock(endpoint, str(rank_key), str(keys / "learner.key"), 1, timeout_s=60)) == 32
    code = rank0.wait(timeout=120)
    log = _log(rank0)
    assert code == REFUSED, log[-3000:]
    refusal = [line for line in log.splitlines() if "refused the ring" in line]
    assert len(refusal) == 1 and "rank(s) 1 did not prove they hold this run's ring secret" in refusal[0], log[-3000:]
    assert "learner ready" not in log
    assert jsonl(Path(cfg.run_dir) / "metrics.jsonl") == []
    assert "intruder: sent junk proofs" in _log(intruder)


def test_a_follower_refuses_a_rank0_it_cannot_authenticate(run_config, spawn, tmp_path, free_port):
    keys, rank_key, _ = _keys(tmp_path)
    config, cfg = _keyed_config(run_config, free_port, keys, rank_key, distributed={"idle_timeout_seconds": 8})
    hostfile = _hostfile(tmp_path, free_port, 2)
    door = f"tcp://127.0.0.1:{cfg.distributed.door_port}"
    impostor = spawn("--impostor-door", door, "120", script=INTRUDER, name="impostor", env=_rank_env(hostfile, 0))
    follower = spawn("learner", "--config", str(config), name="rank1", env=_rank_env(hostfile, 1))
    code = follower.wait(timeout=120)
    log = _log(follower)
    assert code == REFUSED, log[-3000:]
    refusal = [line for line in log.splitlines() if "refused rank 0" in line]
    assert len(refusal) == 1 and "no rank 0 holding the secret half of" in refusal[0], log[-3000:]
    assert "ready" not in log and "Traceback" not in log, log[-3000:]
    assert "intruder: in the ring as rank 0 of 2" in _log(impostor)


@pytest.mark.slow
def test_ranks_with_keys_authenticate_and_train(run_config, spawn, tmp_path, free_port):
    keys, rank_key, actor_key = _keys(tmp_path)
    config, cfg = _keyed_config(run_config, free_port, keys, rank_key, generation={"max_tokens": 5},
                                train={"steps": 3})
    hostfile = _hostfile(tmp_path, free_port, 2)
    rank0 = spawn("learner", "--config", str(config), name="rank0", env=_rank_env(hostfile, 0))
    rank1 = spawn("learner", "--config", str(config), name="rank1", env=_rank_env(hostfile, 1))
    actor = spawn("actor", "--connect", cfg.server.bind, "--actor-id", "keyed", "--key", str(actor_key),
                  "--learner-key", str(keys / "learner.key"), "--metrics-port", "0", "--request-timeout", "3",
                  "--model-dir", cfg.run_dir, name="actor")
    assert rank0.wait(timeout=300) == 0, _log(rank0)[-3000:]
    assert rank1.wait(timeout=60) == 0, _log(rank1)[-3000:]
    assert actor.wait(timeout=30) == 0
    assert "rank 0: all 2 ranks proved they belong to the run" in _log(rank0)
    assert "rank 1: authenticated at rank 0's ring door" in _log(rank1)
    assert "rank 1: rank 0 says stop after 3 steps" in _log(rank1)
    assert [r["step"] for r in jsonl(Path(cfg.run_dir) / "metrics.jsonl")] == [1, 2, 3]


def _three_ranks(spawn, hostfile: Path, *args: str, tag: str) -> list:
    return [spawn("learner", *args, name=f"{tag}{rank}", env=_rank_env(hostfile, rank)) for rank in range(3)]


@pytest.mark.slow
def test_a_hung_rank_of_three_stops_the_others_cleanly_and_three_ranks_resume(run_config, spawn, tmp_path, free_port):
    """MLX #4475's ring all_sum hang at 3+ ranks, played by SIGSTOP: the watchdog turns it into a clean stop."""
    target = 6  # the hang comes after step 3: a rank 0 blocked in the next collective stops at step 4 at most
    config, cfg = run_config(generation={"max_tokens": 5}, task={"num_train": 100}, grpo={"groups_per_step": 2},
                             train={"steps": target, "checkpoint_every": 2},
                             server={"lease_seconds": 5.0, "heartbeat_seconds": 0.5},
                             # A step's collective on a ring of three CPU-starved ranks (CI runs four workers on two
                             # cores) once took more than 8 s with no rank hung; the hung one is still caught.
                             distributed={"timeout_seconds": 15, "keepalive_seconds": 0.5,
                                          # A rank waiting for rank 0's next command, behind the hung one, learns
                                          # that rank 0 is gone only when this runs out.
                                          "idle_timeout_seconds": 30})
    run_dir = Path(cfg.run_dir)
    ranks = _three_ranks(spawn, _hostfile(tmp_path, free_port, 3), "--config", str(config), tag="first")
    actors = [spawn("actor", "--connect", cfg.server.bind, "--actor-id", f"dp3-{i}", "--metrics-port", "0",
                    "--request-timeout", "3", "--model-dir", str(run_dir), name=f"actor{i}") for i in range(2)]
    wait_steps(run_dir, 3, ranks[0], timeout=300)
    os.killpg(ranks[2].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        codes, ended = [], []
        for rank in ranks[:2]:
            codes.append(rank.wait(timeout=120))
            ended.append(time.monotonic() - stopped)
    finally:
        os.killpg(ranks[2].pid, signal.SIGKILL)
        ranks[2].wait()
    logs = [_log(rank) for rank in ranks[:2]]
    assert codes == [RANKS_FAILED, RANKS_FAILED], [log[-2000:] for log in logs]
    # A watchdog caught the hang: rank 0's own, or rank 1's first (both wait in the same collective), whose exit rank 0
    # then meets as a lost peer. Either way rank 0 stops without a checkpoint.
    assert any("did not finish within 15 s" in log for log in logs), [log[-2000:] for log in logs]
    assert "did not finish within 15 s" in logs[0] or "is gone; exiting" in logs[0], logs[0][-3000:]
    assert "exiting without a checkpoint" in logs[0], logs[0][-3000:]
    done = len(jsonl(run_dir / "metrics.jsonl"))
    staging = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    assert staging == [] and done < target
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None
    saved = read_state(checkpoint)["step"]
    print(f"3 ranks: SIGSTOP of rank 2 after step {done}; ranks 0 and 1 exited {RANKS_FAILED} "
          f"{ended[0]:.1f} s and {ended[1]:.1f} s later; last checkpoint step {saved}")

    resumed_at = time.monotonic()
    again = _three_ranks(spawn, _hostfile(tmp_path, free_port, 3, "hosts2.json"), "--resume", str(run_dir), tag="again")
    assert again[0].wait(timeout=400) == 0, _log(again[0])[-3000:]
    assert all(rank.wait(timeout=60) == 0 for rank in again[1:]), [_log(r)[-2000:] for r in again[1:]]
    print(f"3 ranks resumed from step {saved} and finished step {target} in {time.monotonic() - resumed_at:.1f} s")
    for rank in (1, 2):
        assert f"rank {rank}: rank 0 says stop after {target - saved} steps" in _log(again[rank])
    assert all(actor.wait(timeout=30) == 0 for actor in actors)
    steps = [r["step"] for r in jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, target + 1)), steps
    audit = audit_ledger(run_dir / "ledger.jsonl")
    assert set(audit.accepted) == finished_in_checkpoint(read_state(latest_checkpoint(run_dir))["scheduler"])  # type: ignore[arg-type]


def test_a_ring_on_a_public_address_is_refused_before_connecting_unless_trusted(run_config, spawn, tmp_path):
    config, _ = run_config(distributed={"idle_timeout_seconds": 5})
    hostfile = tmp_path / "public.json"
    hostfile.write_text(json.dumps([["127.0.0.1:40001"], ["203.0.113.7:40002"]]))
    ranks = [spawn("learner", "--config", str(config), name=f"rank{rank}", env=_rank_env(hostfile, rank))
             for rank in (0, 1)]
    for proc in ranks:
        assert proc.wait(timeout=60) == REFUSED, _log(proc)[-2000:]
        log = _log(proc)
        assert "non-private addresses (203.0.113.7:40002)" in log and "trusted_network" in log, log[-2000:]
        assert "connecting to the other ranks" not in log and "Traceback" not in log
    trusted = spawn("learner", "--config", str(config), "--set", "distributed.trusted_network=true", name="trusted",
                    env=_rank_env(hostfile, 0))
    assert trusted.wait(timeout=60) != 0  # nobody at 203.0.113.7: it gives up connecting, after trying
    assert "rank 0: connecting to the other ranks" in _log(trusted)
