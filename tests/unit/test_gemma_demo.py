"""The Gemma 3 270M demo's packaged task: its config, its rewards, and its prompts encoded with Gemma's <bos> first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gguf_synth import spm_vocab, tiny_args, tiny_model, write_model_gguf
from grpo_fleet.config import RunConfig
from grpo_fleet.launch.demo import DemoOptions, demo_settings, packaged_demo
from grpo_fleet.models.gguf.importer import import_gguf
from grpo_fleet.tasks import reward_module as reward_module_mod
from grpo_fleet.tasks import rewards as registry
from grpo_fleet.tasks.prompts import encode_prompt

FOLDER = packaged_demo("gemma3-270m").parent


def test_the_packaged_demo_runs_gemma_on_files_beside_it() -> None:
    cfg = RunConfig.model_validate(demo_settings(DemoOptions(model="gemma3-270m")))
    assert cfg.model.path == "zoo:gemma3-270m" and not cfg.task.chat_template
    for path in (cfg.task.train_path, cfg.task.eval_path, cfg.task.reward_module):
        assert path is not None and Path(path).parent == FOLDER.resolve()
    rows = [json.loads(line) for name in ("train", "eval") for line in (FOLDER / f"capitals_{name}.jsonl").open()]
    assert len(rows) == 56 and all(row["prompt"].startswith("<bos>Q: ") and row["prompt"].endswith("?\nA:") for row in rows)
    train = {row["answer"] for row in rows[:24]}
    assert not train & {row["answer"] for row in rows[24:]}  # held out: no country in both


@pytest.mark.parametrize(("completion", "names", "only"), [
    (" Nairobi\nQ: What is", 1.0, 1.0), (" Nairobi.", 1.0, 1.0), (" Nairobi, Kenya\n", 1.0, 0.0),
    (" Mombasa\nNairobi", 0.0, 0.0), ("", 0.0, 0.0), (" The capital is Nairobi", 1.0, 0.0),
])
def test_only_the_answer_line_is_judged(completion: str, names: float, only: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "REWARDS", {})  # a private registry: the SmolLM2 demo's file has a reward of this name
    monkeypatch.setattr(reward_module_mod, "REWARDS", registry.REWARDS)
    named, alone = reward_module_mod.load_rewards(["names_the_capital", "only_the_capital"], str(FOLDER / "capitals_rewards.py"))
    assert named(completion, "", answer="Nairobi") == names
    assert alone(completion, "", answer="Nairobi") == only


def test_a_plain_prompt_reaches_gemma_with_its_bos_first(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load

    vocab = spm_vocab()
    args = tiny_args("gemma3", len(vocab.tokens))
    written = write_model_gguf(tmp_path / "g.gguf", tiny_model(args), args, vocab, chat_template=None)
    tokenizer = load(import_gguf(written.path, tmp_path / "out"))
    ids = encode_prompt(tokenizer, "<bos>Q: the world?\nA:", chat_template=False)
    assert ids[0] == vocab.tokens.index("<bos>") and ids.count(ids[0]) == 1
