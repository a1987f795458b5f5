"""The W&B tracker, offline: what it logs lands in the run's .wandb file, and a resume continues the same W&B run.

W&B starts its own service process (wandb-core), which is why this is an
integration test; the fixture ends it. The .wandb file is read back with W&B's
own protobuf Record, from the record framing its SDK writes (a LevelDB-style
log: a 7-byte header, then checksummed records in 32 KiB blocks).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from pathlib import Path
from typing import Iterator

import pytest
import wandb
from prometheus_client import CollectorRegistry, Counter
from wandb.proto import wandb_internal_pb2

from grpo_fleet.config import LoggingConfig, RunConfig
from grpo_fleet.learner.records.trackers import build_trackers, scalars_of
from helpers import step_record

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
FULL, LAST = 1, 4


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """Every Record in a .wandb file, each chunk's checksum verified."""
    data = path.read_bytes()
    assert data[: len(HEADER)] == HEADER, f"{path} is not a W&B transaction log"
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (checksum, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"corrupt chunk at byte {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def run_ids(path: Path) -> set[str]:
    return {r.run.run_id for r in wandb_records(path) if r.WhichOneof("record_type") == "run"}


def started_config(path: Path) -> dict:
    """The config the W&B run was started with: what runs are compared by."""
    runs = [r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run"]
    return {item.key: json.loads(item.value_json) for item in runs[0].config.update}


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B's own config, cache and data directories under tmp_path, never online, its service ended afterwards."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    wandb.teardown()  # ends the wandb-core process this test started


def test_wandb_offline_records_every_step_and_a_resume_continues_the_run(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = RunConfig(run_dir=str(run_dir), logging=LoggingConfig(report_to=["wandb"], wandb_project="trackers-test"))
    registry = CollectorRegistry()
    errors = Counter("grpo_fleet_learner_tracker_errors", "test", ["tracker"], registry=registry)

    first = build_trackers(cfg, run_dir, errors, run_id="a1b2c3d4e5f6")
    for step in (1, 2, 3):
        first.log_record(step_record(step))
    first.close()
    resumed = build_trackers(cfg, run_dir, errors, run_id="a1b2c3d4e5f6", first_step=3)
    for step in (3, 4):
        resumed.log_record(dataclasses.replace(step_record(step), reward_mean=10.0 * step))
    resumed.log(4, {"eval/reward": 0.5})
    resumed.close()
    # finish() returns once W&B's service has the run's exit; the service process writes the .wandb file
    # itself and may still be flushing it (seen under load: the resumed file read back empty). Ending the
    # service, as the learner's exit does, leaves both files complete.
    wandb.teardown()

    logs = sorted(run_dir.glob("wandb/offline-run-*/run-a1b2c3d4e5f6.wandb"))
    assert len(logs) == 2, "one offline run directory per process, both under the run's W&B id"
    ids = {path.parent.name: run_ids(path) for path in logs}
    assert all(found == {"a1b2c3d4e5f6"} for found in ids.values()), ids
    assert started_config(logs[0])["grpo"] == cfg.grpo.model_dump(mode="json")
    before, after = history(logs[0]), history(logs[1])
    assert [row["_step"] for row in before] == [1, 2, 3] and [row["_step"] for row in after] == [3, 4]
    expected = scalars_of(step_record(2))
    assert {key: before[1][key] for key in expected} == pytest.approx(expected)
    assert "skipped" not in before[1] and "step" not in before[1]
    assert [row["reward_mean"] for row in after] == [30.0, 40.0]
    assert after[1]["eval/reward"] == 0.5, "an eval row at a step joins that step's history row"
    assert registry.get_sample_value("grpo_fleet_learner_tracker_errors_total", {"tracker": "wandb"}) is None
