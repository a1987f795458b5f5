"""Tasks with no download: reasoning-gym's procedural generators, scored by their own `score_answer`.

    [task]
    name = "reasoning_gym"
    dataset = "chain_sum:2,basic_arithmetic:1"   # one generator, or a weighted mix
    generator_options = {chain_sum = {min_terms = 2, max_terms = 3}}
    rewards = ["reasoning_gym"]

num_train and num_eval are the sizes; the train split is drawn with task.seed and
the eval split with task.seed + 1, so any size at any difficulty comes from the
generators themselves. Each example keeps the generator's metadata as a column,
which is what the `reasoning_gym` reward hands back to the generator's scorer.
The reward scores the last `<answer>...</answer>` of a completion (reasoning-gym's
convention; ask for it in task.system_prompt), or the whole completion without one.
Needs `pip install grpo-fleet[reasoning-gym]` on the learner and every actor.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional

from grpo_fleet.tasks.examples import Example
from grpo_fleet.tasks.rewards import register_reward

REWARD = "reasoning_gym"
EVAL_SEED_OFFSET = 1


class ReasoningGymError(ValueError):
    """reasoning-gym is missing, or task.dataset names no generator of it."""


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymError("task 'reasoning_gym' needs the reasoning-gym package: "
                                "pip install 'grpo-fleet[reasoning-gym]'") from exc
    return reasoning_gym


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """[("chain_sum", 2.0), ("basic_arithmetic", 1.0)] from "chain_sum:2,basic_arithmetic:1" (weight 1 if none)."""
    mix = []
    for part in (p.strip() for p in spec.split(",")):
        name, _, weight = part.partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ReasoningGymError(f"task.dataset {spec!r}: weight {weight!r} of {name!r} is not a number") from None
        if not name or not value > 0:
            raise ReasoningGymError(f"task.dataset {spec!r}: each part is NAME or NAME:WEIGHT with WEIGHT > 0")
        mix.append((name.strip(), value))
    return mix


def generate(spec: str, options: dict[str, dict[str, Any]], size: int, seed: int) -> list[Example]:
    """`size` examples of the generator (or weighted mix) `spec`, drawn with `seed`."""
    library = _library()
    mix = parse_mix(spec)
    unknown = [name for name, _ in mix if name not in library.factory.DATASETS]
    if unknown:
        raise ReasoningGymError(f"task.dataset: reasoning-gym has no generator {unknown[0]!r}; it has "
                                f"{', '.join(sorted(library.factory.DATASETS))}")
    if len(mix) == 1:
        dataset = library.create_dataset(mix[0][0], size=size, seed=seed, **options.get(mix[0][0], {}))
    else:
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=name, weight=weight, config=dict(options.get(name, {}))) for name, weight in mix]
        dataset = library.create_dataset("composite", size=size, seed=seed, datasets=specs)
    return [_example(entry) for entry in dataset]


def _example(entry: dict[str, Any]) -> Example:
    # Through JSON: the metadata travels to actors as a column, so tuples become lists here, as they would there.
    metadata = json.loads(json.dumps(entry["metadata"], default=str))
    return Example(prompt=str(entry["question"]), answer=str(entry["answer"]), columns={"metadata": metadata})


def make_splits(spec: str, options: dict[str, dict[str, Any]], num_train: int, num_eval: int,
                seed: int) -> tuple[list[Example], list[Example]]:
    return generate(spec, options, num_train, seed), generate(spec, options, num_eval, seed + EVAL_SEED_OFFSET)


@functools.lru_cache(maxsize=None)
def _scorer(name: str) -> Callable[..., float]:
    scorer: Callable[..., float] = _library().get_score_answer_fn(name)
    return scorer


@register_reward(REWARD)
def reasoning_gym_score(completion: str, prompt: str, *, answer: str, metadata: Optional[dict[str, Any]] = None,
                        **columns: Any) -> Optional[float]:
    """The generator's own score_answer (0..1) of the completion's last <answer>, or of the whole completion.

    None (no opinion) for an example that did not come from reasoning-gym (no source_dataset in its metadata).
    """
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        return None
    from reasoning_gym.utils import extract_answer

    given = extract_answer(completion)
    entry = {"question": prompt, "answer": answer, "metadata": metadata}
    return float(_scorer(str(metadata["source_dataset"]))(answer=completion.strip() if given is None else given,
                                                          entry=entry))
