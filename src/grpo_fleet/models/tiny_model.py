"""The self-built tiny model used by the tests and the demo: a BPE tokenizer over the task's own characters and a
random-init llama, written as an HF-format directory that `mlx_lm.load` reads like any other."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from grpo_fleet.config import TinyModelConfig
from grpo_fleet.models.loading import atomic_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<unk>"]
EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|pad|>", "<unk>"
# A ChatML-style template so the chat path can be exercised with the tiny model.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _train_tokenizer(corpus: list[str], vocab_size: int) -> Any:
    """A BPE tokenizer over the corpus's own characters, with digits kept one per token.

    Keeping the alphabet to what the task uses makes a random policy score above
    zero, which is what gives GRPO its first signal.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Metaspace(prepend_scheme="never")]
    )
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    alphabet = sorted({ch for line in corpus for ch in line.replace(" ", "\u2581")})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def _write_tokenizer(tokenizer: Any, out: Path) -> list[int]:
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "bos_token": None,
        "chat_template": TINY_CHAT_TEMPLATE,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
    }
    with open(out / "tokenizer_config.json", "w") as handle:
        json.dump(config, handle, indent=2)
    return [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id("<|im_end|>")]


def _tiny_model_config(cfg: TinyModelConfig, vocab_size: int, eos_ids: list[int]) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": eos_ids,
        "pad_token_id": eos_ids[0],
        "torch_dtype": "float32",
    }


def _init_tiny_weights(config: dict, seed: int) -> nn.Module:
    """Random init from mlx_lm's ModelArgs, with small embeddings so the first policy is near-uniform."""
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = llama.Model(args)
    embed = model.model.embed_tokens
    embed.weight = mx.random.normal(embed.weight.shape, scale=0.02)
    mx.eval(model.parameters())
    return model


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig, corpus: list[str]) -> Path:
    """Build (or reuse) the tiny HF-format model directory; deterministic for a seed and corpus."""
    from mlx_lm.utils import save_config, save_model

    final = Path(out_dir)
    if (final / "config.json").exists() and (final / "tokenizer.json").exists():
        return final
    staging = atomic_dir(final)
    tokenizer = _train_tokenizer(corpus, cfg.vocab_size)
    eos_ids = _write_tokenizer(tokenizer, staging)
    config = _tiny_model_config(cfg, tokenizer.get_vocab_size(), eos_ids)
    model = _init_tiny_weights(config, cfg.seed)
    save_model(staging, model)
    save_config(config, staging / "config.json")
    if final.exists():
        shutil.rmtree(staging)
        return final
    os.rename(staging, final)
    return final
