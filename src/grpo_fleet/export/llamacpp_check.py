"""llama.cpp as the reader of an exported GGUF: its greedy continuations next to mlx-lm's on the fused model.

Both sides are given the same prompt token ids (the fused model's tokenizer with its chat template), so a
difference is the weights' or the arithmetic's, not the tokenizers'; llama.cpp's own tokenizer (from the GGUF's
metadata) is compared separately on the same texts. Needs llama-cpp-python (the `llamacpp` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import mlx.core as mx

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "tasks" / "data" / "gsm8k_mini.jsonl"


@dataclass(frozen=True)
class Agreement:
    """How often llama.cpp's greedy continuation equals mlx-lm's, over `prompts` prompts of `tokens` tokens."""

    prompts: int
    tokens: int
    identical: int  # prompts whose whole continuation is the same
    same_tokens: int  # tokens equal up to the first difference in each continuation (a shared prefix, summed)
    tokenizer_identical: int  # prompts llama.cpp tokenizes to the same ids as the fused model's tokenizer

    def describe(self) -> str:
        return (f"{self.identical}/{self.prompts} continuations identical, {self.same_tokens}/{self.prompts * self.tokens} "
                f"tokens before the first difference; tokenizer {self.tokenizer_identical}/{self.prompts}")


def prompt_texts(count: int) -> list[str]:
    """`count` questions (the packaged GSM8K sample, repeated with a number if it has fewer)."""
    questions = [json.loads(line)["question"] for line in PROMPTS_FILE.read_text().splitlines() if line.strip()]
    return [questions[i % len(questions)] + ("" if i < len(questions) else f" ({i})") for i in range(count)]


def chat_prompt(tokenizer: Any, question: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True))
    return question


def llamacpp_greedy(llm: Any, prompt: list[int], count: int) -> list[int]:
    tokens = []
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == count:
            break
    return tokens


def _shared(left: list[int], right: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))


def mlx_reproduces(model: Any, prompt: list[int], continuation: list[int]) -> int:
    """How many tokens of `continuation` mlx-lm's greedy decoding of `model` after `prompt` gives before its first
    difference. Greedy decoding takes the argmax after each prefix, so one forward pass over prompt + continuation
    has them all: the model is read once, not once a token (on a CPU each read of SmolLM2's 0.5 GB is most of a
    token's time)."""
    if not continuation:
        return 0
    logits = model(mx.array([prompt + continuation[:-1]]))[0, len(prompt) - 1:]
    return _shared(cast(list[int], mx.argmax(logits, axis=-1).tolist()), continuation)


def greedy_agreement(llm: Any, model: Any, prompts: list[list[int]], tokens: int) -> tuple[int, int]:
    """(prompts whose continuations are identical, tokens before the first difference, summed): llama.cpp's `llm`
    generating greedily, `tokens` tokens after each prompt, against mlx-lm's `model` greedy on the same prefixes."""
    identical = same = 0
    for ids in prompts:
        theirs = llamacpp_greedy(llm, ids, tokens)
        shared = mlx_reproduces(model, ids, theirs)
        identical += shared == len(theirs) == tokens
        same += shared
    return identical, same


def agreement(ours: Callable[[list[int]], list[int]], theirs: Callable[[list[int]], list[int]],
              prompts: list[list[int]]) -> tuple[int, int]:
    """(identical continuations, tokens before the first difference, summed) of two greedy decoders on `prompts`."""
    identical = same = 0
    for ids in prompts:
        left, right = ours(ids), theirs(ids)
        identical += left == right
        same += _shared(left, right)
    return identical, same


def open_gguf(gguf: Path) -> Any:
    """llama.cpp's model on one thread (the comparisons are about numbers, not speed)."""
    from llama_cpp import Llama

    return Llama(model_path=str(gguf), n_ctx=1024, n_threads=1, n_batch=256, verbose=False)


def compare(gguf: Path, model: Any, tokenizer: Any, prompts: int = 32, tokens: int = 16) -> Agreement:
    """llama.cpp on `gguf` against mlx-lm on `model` (the fused model), greedy, `prompts` chat prompts x `tokens`."""
    llm = open_gguf(gguf)
    chats = [chat_prompt(tokenizer, text) for text in prompt_texts(prompts)]
    ids = [list(tokenizer.encode(chat, add_special_tokens=False)) for chat in chats]
    tokenized = sum(llm.tokenize(chat.encode(), add_bos=False, special=True) == want for chat, want in zip(chats, ids))
    identical, same = greedy_agreement(llm, model, ids, tokens)
    llm.close()
    return Agreement(prompts, tokens, identical, same, tokenized)
