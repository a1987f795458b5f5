"""Models the benchmarks run on: the demo's tiny model and a ~50M-parameter one, built locally."""

from __future__ import annotations

from pathlib import Path

from grpo_fleet.config import TaskConfig, TinyModelConfig
from grpo_fleet.learner.run.build import tokenizer_corpus
from grpo_fleet.models.tiny_model import build_tiny_model
from grpo_fleet.tasks import build_task

# ~50M parameters: 10 blocks of width 640 (attention 1.6M + MLP 3.3M each).
MODEL_50M = TinyModelConfig(seed=0, hidden_size=640, num_layers=10, num_heads=10, intermediate_size=1728, vocab_size=512)


def reverse_corpus() -> list[str]:
    return tokenizer_corpus(build_task(TaskConfig(name="reverse", digits=3, num_train=800, num_eval=128)))


def tiny_model(root: Path) -> Path:
    """The demo's model (2 layers, width 64) with the reverse task's tokenizer."""
    return build_tiny_model(root / "tiny", TinyModelConfig(), reverse_corpus())


def model_50m(root: Path) -> Path:
    """The ~50M-parameter benchmark model, same architecture family and tokenizer recipe."""
    return build_tiny_model(root / "model-50m", MODEL_50M, reverse_corpus())
