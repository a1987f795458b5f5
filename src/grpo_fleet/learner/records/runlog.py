"""The run's append-only logs: metrics.jsonl (a line per step), ledger.jsonl (a line per accepted group,
and one per accepted group later dropped untrained) and samples.jsonl (a few decoded completions every
`train.log_samples_every` steps).

The ledger is what proves exactly-once: every accepted group is trained unless its
line says `zero_variance` (nothing to learn from it) or a later "dropped" line names
it (and the new group its prompt was retried as). A
resume cuts every log back to its length at the checkpoint, because the work
they record after it is re-done. A checkpoint fsyncs the logs before it is
written (sync_logs), so a log is never shorter than one records; a resume that
finds one shorter refuses (ShortLog) rather than run on a ledger that lost lines.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Optional

from grpo_fleet.learner.step.update_stats import UpdateStats
from grpo_fleet.runtime.durable import sync_path

METRICS_FILE = "metrics.jsonl"
LEDGER_FILE = "ledger.jsonl"
SAMPLES_FILE = "samples.jsonl"


@dataclass(frozen=True, kw_only=True)
class StepRecord(UpdateStats):
    """One learner step, as its metrics.jsonl line (docs/reference/run-files.md lists these keys): the update's stats
    and the batch's."""

    step: int
    policy_version: int
    reward_mean: float
    reward_std: float
    completion_length_mean: float  # tokens per completion
    completion_length_max: float
    truncated_fraction: float  # completions cut off at generation.max_tokens
    groups: int
    tokens: int
    # Versions between the snapshot that sampled a group and the policy it trained.
    staleness_mean: float
    staleness_max: int
    zero_variance_fraction: float
    step_seconds: float
    wall_seconds: float
    actors: int
    # The logprob check of this step's groups: seconds spent (forwards at older versions plus the comparison against
    # the step's own forward; the slowest rank's), and how many groups were checked and trained unchecked.
    check_seconds: float = 0.0
    groups_checked: int = 0
    groups_unchecked: int = 0
    # Episodes (task.env) only, else None: turns per episode, well-formed <tool_call>s per episode, the share of
    # episodes that made one, and the share of attempted calls that were malformed (learner/run/episode_stats.py).
    episode_turns_mean: Optional[float] = None
    tool_calls_per_episode: Optional[float] = None
    tool_call_episode_fraction: Optional[float] = None
    tool_call_malformed_fraction: Optional[float] = None


@dataclass(frozen=True)
class EvalRecord:
    """One eval round, as its metrics.jsonl line (with "event": "eval"; step lines have no "event")."""

    step: int  # the step the round was started at (0: before training)
    policy_version: int  # the version when it started
    eval_reward: Optional[float]  # avg@k: mean over prompts of the mean of their k samples (None: none scored)
    eval_pass_at_k: Optional[float]  # share of prompts with a sample reaching train.eval_pass_reward
    k: int
    mode: str  # greedy | sampled
    prompts: int
    scored: int
    dropped: int  # prompts left out: unscorable MAX_EVAL_ATTEMPTS times
    on_learner: int  # prompts the learner evaluated itself (no actor connected)
    # Versions that sampled the round: actors may be behind or ahead of `policy_version` by the in-flight steps.
    sampled_version_min: int
    sampled_version_max: int
    seconds: float


@dataclass(frozen=True)
class LedgerEntry:
    """One accepted group, as its ledger.jsonl line."""

    group_id: str
    prompt_index: int
    actor_id: str
    actor_key: str  # the peer key it was accepted from: CURVE public key, else routing id
    policy_version: int
    step: int  # the step it was accepted during (trained in a later one)
    # Every completion scored the same, so every advantage is zero: counted, never buffered or trained.
    zero_variance: bool = False


@dataclass(frozen=True)
class DropEntry:
    """An accepted group taken out of the buffer untrained, as its ledger.jsonl line (with "event": "dropped")."""

    group_id: str
    prompt_index: int
    actor_id: str
    actor_key: str
    reason: str  # a RejectReason: logprob_mismatch (its actor lied) or stale_at_train (buffered too long)
    step: int  # the step it was dropped during
    retried_as: str  # the new group its prompt was queued as


@dataclass(frozen=True)
class UncheckedEntry:
    """A group trained without a logprob check, as its ledger.jsonl line (with "event": "unchecked")."""

    group_id: str
    actor_id: str
    actor_key: str
    reason: str  # sampled_out, verification_off or version_gone (grpo_fleet_learner_groups_unchecked_total)
    step: int  # the step that trained it


@dataclass(frozen=True)
class SampleRow:
    """One completion the model wrote, decoded, as its samples.jsonl line (learner/records/samples.py picks them)."""

    step: int  # the step that trained on it
    policy_version: int  # the snapshot that sampled it
    group_id: str
    prompt_index: int
    actor_id: str
    prompt: str
    completion: str
    reward: float
    advantage: float  # its group-relative advantage, as the step computed it
    finish_reason: str
    num_tokens: int  # completion tokens
    # An episode's (task.env) text run by run, in order: [["model", text], ["environment", text], ...]; [] otherwise.
    turns: list[list[str]] = field(default_factory=list)
    end: str = ""  # why the episode ended ("done", "max_turns", "budget"); "" for a single completion


@dataclass(frozen=True)
class LogSizes:
    """Byte lengths of the logs: what a checkpoint records and a resume cuts back to."""

    ledger_bytes: int = 0
    metrics_bytes: int = 0
    samples_bytes: int = 0


class RunLog:
    """Appends to the logs, line-buffered, so a kill loses at most the line being written."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._metrics = open(run_dir / METRICS_FILE, "a", buffering=1)
        self._ledger = open(run_dir / LEDGER_FILE, "a", buffering=1)
        self._samples = open(run_dir / SAMPLES_FILE, "a", buffering=1)

    def step(self, record: StepRecord) -> None:
        self._metrics.write(json.dumps(asdict(record)) + "\n")

    def eval(self, record: EvalRecord) -> None:
        self._metrics.write(json.dumps({"event": "eval", **asdict(record)}) + "\n")

    def ledger(self, entry: LedgerEntry) -> None:
        self._ledger.write(json.dumps(asdict(entry)) + "\n")

    def dropped(self, entry: DropEntry) -> None:
        self._ledger.write(json.dumps({"event": "dropped", **asdict(entry)}) + "\n")

    def unchecked(self, entry: UncheckedEntry) -> None:
        self._ledger.write(json.dumps({"event": "unchecked", **asdict(entry)}) + "\n")

    def samples(self, rows: list[SampleRow]) -> None:
        # json.dumps escapes control characters, so model output stays one line.
        self._samples.write("".join(json.dumps(asdict(row)) + "\n" for row in rows))

    def sizes(self) -> LogSizes:
        """Current lengths, everything written so far flushed to the files first."""
        return LogSizes(ledger_bytes=_flushed_size(self._ledger), metrics_bytes=_flushed_size(self._metrics),
                        samples_bytes=_flushed_size(self._samples))

    def truncate(self, sizes: LogSizes) -> None:
        """Forget what was logged after `sizes` was taken (the files are in append mode, so writing goes on at the end).

        A log shorter than `sizes` raises ShortLog, and then no log is cut."""
        self._ledger.flush()
        self._metrics.flush()
        self._samples.flush()
        check_log_lengths(self.run_dir, sizes)
        for name, size in _by_file(sizes):
            truncate_log(self.run_dir / name, size)

    def close(self) -> None:
        self._metrics.close()
        self._ledger.close()
        self._samples.close()


def _flushed_size(handle: IO[str]) -> int:
    handle.flush()
    return Path(handle.name).stat().st_size


class ShortLog(ValueError):
    """A log is shorter than the checkpoint being resumed recorded: lines it counts on were lost."""


def _by_file(sizes: LogSizes) -> list[tuple[str, int]]:
    return [(LEDGER_FILE, sizes.ledger_bytes), (METRICS_FILE, sizes.metrics_bytes), (SAMPLES_FILE, sizes.samples_bytes)]


def sync_logs(run_dir: Path) -> None:
    """fsync the logs (flushed by `RunLog.sizes`), so that none is shorter than a checkpoint written after this says."""
    for name, _ in _by_file(LogSizes()):
        if (run_dir / name).exists():
            sync_path(run_dir / name)


def check_log_lengths(run_dir: Path, sizes: LogSizes) -> None:
    """Raise ShortLog, in one line naming the file and both lengths, for a log shorter than `sizes` records."""
    for name, size in _by_file(sizes):
        path = run_dir / name
        have = path.stat().st_size if path.exists() else 0
        if have < size:
            raise ShortLog(f"{path} is {have} bytes, shorter than the {size} bytes the checkpoint recorded: it lost "
                           "lines the checkpoint counts on, so the run cannot resume exactly-once from it (restore "
                           "the file, or start a new run directory)")


def truncate_log(path: Path, size: int) -> None:
    """Cut an append-only JSONL log back to the length it had at the checkpoint."""
    if path.exists() and path.stat().st_size > size:
        with open(path, "r+b") as handle:
            handle.truncate(size)
