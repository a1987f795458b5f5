"""Prompt encoding (text and chat-format) and the check that prompts fit the model's context."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from grpo_fleet.config import RunConfig
from grpo_fleet.tasks.prompts import PromptTooLong, chat_messages, check_prompt_lengths, context_length, encode_prompt
from in_process import build_learner


class RecordingTokenizer:
    """Encodes characters as ids and renders conversations as 'role: content' lines."""

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, Any]]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tokenize: bool) -> str:
        self.rendered.append(messages)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def test_text_prompt_without_template_is_plain_text() -> None:
    tokenizer = RecordingTokenizer()
    assert encode_prompt(tokenizer, "12=", chat_template=False) == [ord(c) for c in "12="]
    assert tokenizer.rendered == []


def test_text_prompt_with_template_gets_the_system_prompt() -> None:
    tokenizer = RecordingTokenizer()
    encode_prompt(tokenizer, "2+2?", chat_template=True, system_prompt="Be brief.")
    assert tokenizer.rendered == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]]


def test_chat_prompt_always_goes_through_the_template() -> None:
    tokenizer = RecordingTokenizer()
    conversation = ({"role": "user", "content": "2+2?"},)
    ids = encode_prompt(tokenizer, conversation, chat_template=False)
    assert "".join(map(chr, ids)) == "user: 2+2?\nassistant: "


def test_system_prompt_does_not_override_the_datasets_own() -> None:
    own = [{"role": "system", "content": "Think."}, {"role": "user", "content": "q"}]
    assert chat_messages(own, "Be brief.") == own
    assert chat_messages([{"role": "user", "content": "q"}], "Be brief.")[0] == {"role": "system", "content": "Be brief."}


def test_context_length_reads_the_model_args() -> None:
    assert context_length(SimpleNamespace(args=SimpleNamespace(max_position_embeddings=32768))) == 32768
    assert context_length(SimpleNamespace(args=SimpleNamespace())) is None
    assert context_length(object()) is None


def test_prompt_lengths_must_leave_room_for_the_completion() -> None:
    check_prompt_lengths([[0] * 90, [0] * 10], max_new_tokens=10, context=100)
    check_prompt_lengths([[0] * 5000], max_new_tokens=10, context=None)
    with pytest.raises(PromptTooLong, match=r"2 of 3 train prompts .* prompt 2 has 120 tokens.* leaves 90"):
        check_prompt_lengths([[0] * 95, [0] * 10, [0] * 120], max_new_tokens=10, context=100)


def test_learner_refuses_prompts_longer_than_the_model_allows(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The tiny model's context is 2048 tokens; 2046 of completion leave no room for a 4-token "123=".
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "model": {"path": str(tiny_model_dir)},
        "task": {"name": "reverse", "num_train": 20, "num_eval": 4},
        "generation": {"max_tokens": 2046}, "metrics": {"port": 0},
    })
    with pytest.raises(PromptTooLong, match="generation.max_tokens = 2046"):
        build_learner(cfg)
