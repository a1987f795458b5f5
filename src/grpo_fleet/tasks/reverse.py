"""The built-in synthetic task: reverse a string of digits ("482=" -> "284").

Small enough that a tiny random-init model can learn it in minutes, and scored
position by position so learning progress is visible long before exact matches.
"""

from __future__ import annotations

import random
from collections.abc import Collection

from grpo_fleet.tasks.examples import Example

REVERSE_ALPHABET = "0123456789="
PROMPT_SUFFIX = "="


def reverse_example(number_text: str) -> Example:
    """The example for one digit string, e.g. "482" -> Example("482=", "284")."""
    return Example(prompt=number_text + PROMPT_SUFFIX, answer=number_text[::-1])


def _check_space(count: int, digits: int, excluded: int) -> int:
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    space = 10**digits
    if count + excluded > space:
        raise ValueError(
            f"cannot draw {count} distinct {digits}-digit prompts: only {space} exist"
            + (f" and {excluded} of them are excluded" if excluded else "")
        )
    return space


def make_reverse_examples(
    count: int, digits: int, seed: int, exclude: Collection[str] = ()
) -> list[Example]:
    """`count` distinct reversal examples of `digits` digits (leading zeros allowed).

    Deterministic for a given (count, digits, seed, exclude). `exclude` holds
    prompts (e.g. "482=") that must not be drawn, so a train split can avoid
    the eval split.
    """
    excluded = {prompt for prompt in exclude if _is_reverse_prompt(prompt, digits)}
    space = _check_space(count, digits, len(excluded))
    # Drawing len(excluded) extra candidates guarantees `count` survivors after
    # filtering; random.sample on a range never materialises the whole space.
    candidates = random.Random(seed).sample(range(space), min(space, count + len(excluded)))
    examples: list[Example] = []
    for value in candidates:
        example = reverse_example(str(value).zfill(digits))
        if example.prompt in excluded:
            continue
        examples.append(example)
        if len(examples) == count:
            break
    return examples


def _is_reverse_prompt(prompt: str, digits: int) -> bool:
    if not prompt.endswith(PROMPT_SUFFIX):
        return False
    body = prompt[: -len(PROMPT_SUFFIX)]
    return len(body) == digits and body.isascii() and body.isdigit()


def make_reverse_splits(
    num_train: int, num_eval: int, digits: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Disjoint (train, eval) example lists for the reversal task.

    Eval is drawn first so it stays the same when only num_train changes,
    which keeps eval scores comparable across runs of different lengths.
    """
    space = 10**digits
    if num_train + num_eval > space:
        raise ValueError(
            f"task 'reverse' needs num_train + num_eval = {num_train} + {num_eval} distinct prompts, "
            f"but only {space} {digits}-digit prompts exist; lower num_train/num_eval or raise digits"
        )
    eval_examples = make_reverse_examples(num_eval, digits, seed)
    eval_prompts = {example.prompt for example in eval_examples if isinstance(example.prompt, str)}
    train_examples = make_reverse_examples(num_train, digits, seed + 1, exclude=eval_prompts)
    return train_examples, eval_examples
