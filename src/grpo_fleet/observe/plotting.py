"""Training curves of a run directory as one PNG: reward, KL, throughput, staleness, off-policy gap, lengths.

Reads only files the learner writes: RUN_DIR/metrics.jsonl (one line per optimizer
step, see `learner/run/batch_cycle.py: BatchCycle._step_record`, and one per eval round, `"event": "eval"`)
and RUN_DIR/config.json (`grpo.max_staleness`, `grpo.objective`).
Works on a run that is still going: an incomplete last line is skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, TypeGuard

if TYPE_CHECKING:  # matplotlib is imported lazily at run time
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DEFAULT_NAME = "curves.png"


class RunDataError(ValueError):
    """RUN_DIR has no usable metrics.jsonl."""


def load_step_records(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl ([] when it is absent); a half-written last line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):  # the learner is writing it right now
                break
            raise RunDataError(f"{path}:{number}: not JSON ({exc})") from exc
    return [r for r in records if isinstance(r, dict) and "step" in r and "event" not in r]


def load_eval_records(path: Path) -> list[dict]:
    """The eval rounds of a metrics.jsonl (`"event": "eval"` lines), oldest first."""
    path = Path(path)
    if not path.is_file():
        return []
    rounds = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a half-written last line; load_step_records reports worse ones
            continue
        if isinstance(record, dict) and record.get("event") == "eval":
            rounds.append(record)
    return rounds


def read_step_records(run_dir: Path) -> list[dict]:
    """The step records of RUN_DIR/metrics.jsonl; a clear error when there are none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RunDataError(f"{path} not found: is {run_dir} a grpo-fleet run directory, and has the learner taken a step?")
    records = load_step_records(path)
    if not records:
        raise RunDataError(f"{path} has no step records yet")
    return records


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that have a finite `key`."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if _finite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start, so the curve begins at step one)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    return max(1, min(50, n // 30))


def throughput(records: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """(steps, end-to-end tokens/s, trainer tokens/s) per step; NaN where a rate is undefined.

    End to end: the step's `tokens` over the `wall_seconds` elapsed since the previous
    step, i.e. what the fleet delivers (undefined for the first record, or if the clock
    did not advance). Trainer: `tokens` over `step_seconds`, the learner's own speed,
    an upper bound on the first.
    """
    steps, fleet, trainer = [], [], []
    previous_wall: Optional[float] = None
    for record in records:
        tokens, step_s, wall = record.get("tokens"), record.get("step_seconds"), record.get("wall_seconds")
        wall = float(wall) if _finite(wall) else None
        if _finite(tokens):
            steps.append(record["step"])
            delta = wall - previous_wall if wall is not None and previous_wall is not None else 0.0
            fleet.append(tokens / delta if delta > 0 else math.nan)
            trainer.append(tokens / step_s if _finite(step_s) and step_s > 0 else math.nan)
        if wall is not None:
            previous_wall = wall
    return steps, fleet, trainer


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _defined(steps: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _display_name(run_dir: Path) -> str:
    text = str(run_dir)
    return text if len(text) <= 48 else "/".join(("...",) + run_dir.parts[-2:])


def _curve(ax: Axes, steps: list[float], values: list[float], color: str, label: str, window: int) -> None:
    """Raw values faint, their `window`-step moving average bold."""
    if not steps:
        return
    if window > 1:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smooth(values, window), color=color, linewidth=1.8, label=f"{label} ({window}-step mean)")
    else:
        ax.plot(steps, values, color=color, linewidth=1.5, marker="." if len(steps) < 30 else None, label=label)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_run(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Render RUN_DIR's training curves (3x2: reward, KL, tokens/s, staleness, off-policy gap, completion
    lengths) to a PNG; returns its path.

    `out` defaults to RUN_DIR/curves.png. Raises RunDataError (a ValueError) when
    RUN_DIR/metrics.jsonl is missing or holds no step records.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = sorted(read_step_records(run_dir), key=lambda r: r["step"])
    out = Path(out) if out is not None else run_dir / DEFAULT_NAME
    window = _window(len(records))
    fig = Figure(figsize=(12, 11), dpi=100)
    FigureCanvasAgg(fig)
    (ax_reward, ax_kl), (ax_tps, ax_stale), (ax_gap, ax_length) = fig.subplots(3, 2, sharex=True)
    config = _read_json(run_dir / "config.json")
    _plot_reward(ax_reward, records, load_eval_records(run_dir / "metrics.jsonl"), window)
    _plot_kl(ax_kl, records, window)
    _plot_throughput(ax_tps, records, window)
    _plot_staleness(ax_stale, records, config, window)
    _plot_offpolicy(ax_gap, records, config, window)
    _plot_lengths(ax_length, records, window)
    _finish(fig, (ax_reward, ax_kl, ax_tps, ax_stale, ax_gap, ax_length), records, run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _plot_reward(ax: Axes, records: list[dict], rounds: list[dict], window: int) -> None:
    """Training reward, with the held-out eval rounds (train.eval_every) as their own curve."""
    steps, rewards = _series(records, "reward_mean")
    _curve(ax, steps, rewards, "tab:blue", "train reward (batch mean)", window)
    eval_steps, eval_rewards = _series(rounds, "eval_reward")
    if eval_steps:
        k = rounds[-1].get("k", 1)
        ax.plot(eval_steps, eval_rewards, color="tab:green", marker="o", linewidth=1.8,
                label=f"held-out avg@{k} (last {eval_rewards[-1]:.3f})")
        pass_steps, passed = _series(rounds, "eval_pass_at_k")
        if k > 1 and pass_steps:
            ax.plot(pass_steps, passed, color="tab:olive", marker="s", linewidth=1.2, linestyle="--",
                    label=f"held-out pass@{k}")
    ax.set_title("reward")
    ax.set_ylabel("reward")
    values = rewards + eval_rewards
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        ax.set_ylim(0, 1.05)


def _plot_kl(ax: Axes, records: list[dict], window: int) -> None:
    steps, kl = _series(records, "kl")
    _curve(ax, steps, kl, "tab:red", "KL to pi_ref (k3)", window)
    ax.set_title("KL divergence to the reference policy")
    ax.set_ylabel("KL")
    if not kl:
        _no_data(ax, "kl")


def _plot_throughput(ax: Axes, records: list[dict], window: int) -> None:
    steps, fleet, trainer = throughput(records)
    _curve(ax, *_defined(steps, fleet), "tab:purple", "end to end (tokens / wall time between steps)", window)
    _curve(ax, *_defined(steps, trainer), "tab:orange", "trainer only (tokens / step time)", window)
    ax.set_title("completion tokens per second")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    if not steps:
        _no_data(ax, "tokens")


def _plot_staleness(ax: Axes, records: list[dict], config: dict, window: int) -> None:
    steps, staleness = _series(records, "staleness_mean")
    _curve(ax, steps, staleness, "tab:brown", "mean staleness of the batch", window)
    max_staleness = (config.get("grpo") or {}).get("max_staleness")
    if _finite(max_staleness):
        ax.axhline(max_staleness, color="black", linestyle=":", linewidth=1.2,
                   label=f"max_staleness {max_staleness} (checked on arrival)")
    ax.set_title("staleness (policy versions behind when trained)")
    ax.set_ylabel("versions")
    ax.set_ylim(bottom=0)
    if not staleness:
        _no_data(ax, "staleness_mean")


def _with_fractions(ax: Axes, records: list[dict], series: Sequence[tuple[str, str, str]], window: int,
                    ylabel: str) -> None:
    """(key, color, label) curves on a right-hand axis of their own, one legend for both axes."""
    twin = ax.twinx()
    for key, color, label in series:
        _curve(twin, *_series(records, key), color, label, window)
    twin.set_ylabel(ylabel)
    twin.set_ylim(bottom=0)
    # The left axis in front (with a see-through background), so its legend is not drawn under the twin's lines.
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = twin.get_legend_handles_labels()
    if handles or more_handles:
        ax.legend(handles + more_handles, labels + more_labels, loc="upper left", fontsize=8)


def _plot_offpolicy(ax: Axes, records: list[dict], config: dict, window: int) -> None:
    """How far the actors' pi_behav is from the learner's pi_prox, and what the clip and the behaviour weight did."""
    steps, gap = _series(records, "offpolicy_gap_mean")
    _curve(ax, steps, gap, "tab:red", "mean |log pi_prox - log pi_behav|", window)
    _curve(ax, *_series(records, "offpolicy_gap_max"), "tab:pink", "max |log pi_prox - log pi_behav|", window)
    ratio_steps, ratios = _series(records, "ratio_mean")
    logged = [(s, math.log(r)) for s, r in zip(ratio_steps, ratios) if r > 0]
    _curve(ax, [s for s, _ in logged], [v for _, v in logged], "tab:olive", "log ratio_mean (pi_theta / anchor)", window)
    objective = (config.get("grpo") or {}).get("objective")
    ax.set_title("off-policy gap" + (f" ({objective} objective)" if isinstance(objective, str) else ""))
    ax.set_ylabel("nats")
    fractions = (("is_capped_fraction", "tab:gray", "tokens capped at is_cap (right)"),
                 ("clip_fraction", "tab:purple", "tokens clipped (right)"))
    _with_fractions(ax, records, fractions, window, "fraction of tokens")
    if not gap:
        _no_data(ax, "offpolicy_gap_mean")


def _plot_lengths(ax: Axes, records: list[dict], window: int) -> None:
    steps, mean = _series(records, "completion_length_mean")
    _curve(ax, steps, mean, "tab:cyan", "mean completion length", window)
    _curve(ax, *_series(records, "completion_length_max"), "tab:blue", "longest completion", window)
    ax.set_title("completion length")
    ax.set_ylabel("tokens")
    ax.set_ylim(bottom=0)
    fractions = [("truncated_fraction", "black", "cut off at max_tokens (right)")]
    if _series(records, "tool_call_episode_fraction")[0]:  # episodes that call tools: is the model learning to?
        ax.set_title("completion length, and tool calls")
        fractions += [("tool_call_episode_fraction", "tab:green", "episodes with a well-formed tool call (right)"),
                      ("tool_call_malformed_fraction", "tab:red", "tool calls malformed (right)")]
    _with_fractions(ax, records, fractions, window, "fraction")
    if not mean:
        _no_data(ax, "completion_length_mean")


def _finish(fig: Figure, axes: tuple, records: list[dict], run_dir: Path) -> None:
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    for ax in axes[-2:]:
        ax.set_xlabel("learner step")
    last = records[-1]
    wall = last.get("wall_seconds")
    subtitle = f"{len(records)} steps logged, last step {last['step']}, policy v{last.get('policy_version', '?')}"
    if _finite(wall):
        subtitle += f", {wall:.0f} s training"
    fig.suptitle(f"grpo-fleet {_display_name(run_dir)}: {subtitle}")
    fig.tight_layout()
