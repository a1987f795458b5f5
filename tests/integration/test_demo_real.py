"""`grpo-fleet demo --model smollm2-135m-instruct`: the real pretrained model through the CLI, a few steps.

It checks the plumbing a user relies on (the zoo fetch, the GGUF import on the
learner and on each actor, eval rounds at step 0 and the end, samples, a LoRA
adapter that mlx-lm loads), not that the reward rises: `make bench` (`real`)
measures that over a full run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fleet.runtime.blas import child_env

STEPS = 2
EVAL_PROMPTS = 2


@pytest.mark.slow
def test_demo_real_trains_the_pretrained_model_and_leaves_a_loadable_adapter(smollm2_gguf: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "demo-real"
    args = [sys.executable, "-m", "grpo_fleet", "demo", "--model", "smollm2-135m-instruct", "--steps", str(STEPS),
            "--run-dir", str(run_dir), "--no-progress",
            "--set", f"train.eval_every={STEPS}", "--set", f"task.num_eval={EVAL_PROMPTS}", "--set", "train.eval_samples=1",
            "--set", "train.log_samples_every=1", "--set", f"train.checkpoint_every={STEPS}",
            # The plumbing, not the demo's 4 groups x 8: a quarter of the rollouts and of each step. A batch
            # that small is a noisy gradient; at a fifth of the demo's rate two steps still train the adapter
            # (B is checked below) without moving the model off its answers (measured: "L'Étoile" at 5e-5).
            "--set", "grpo.groups_per_step=2", "--set", "generation.group_size=4", "--set", "optim.lr=1e-5",
            # The half-precision bound, calibrated on the real model from one prompt's group rather than two
            # (bf16 sampling on this CPU: about 9 s a prompt).
            "--set", "security.calibration_prompts=1"]
    done = subprocess.run(args, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr
    # 1 means "ran, but the held-out reward did not rise", which two steps need not show.
    assert done.returncode in (0, 1), output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [step for step, _ in summary["eval_curve"]] == [0, STEPS], summary
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert all(r["prompts"] == EVAL_PROMPTS and r["scored"] == EVAL_PROMPTS for r in rounds), rounds

    # Both actors imported the GGUF themselves (the learner sends the zoo name, not its own directory).
    for actor in ("actor-0.log", "actor-1.log"):
        assert "joined run" in (run_dir / actor).read_text(), (run_dir / actor).read_text()[-2000:]
    config = json.loads((run_dir / "demo-config.json").read_text())
    assert config["model"]["path"] == "zoo:smollm2-135m-instruct"

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in samples} == set(range(1, STEPS + 1)), samples[:2]
    assert all(isinstance(row["completion"], str) for row in samples)

    _check_adapter(Path(summary["checkpoint"]))


def _check_adapter(checkpoint: Path) -> None:
    """The checkpoint is a LoRA adapter over the imported base, loadable by mlx-lm, and trained (B is not zero)."""
    import mlx.core as mx
    import mlx_lm

    adapters = mx.load(str(checkpoint / "adapters.safetensors"))
    b_norms = [float(mx.abs(w).max()) for name, w in adapters.items() if name.endswith("lora_b")]
    assert b_norms and max(b_norms) > 0, "the adapters were never trained (LoRA B starts at zero)"
    base = json.loads((checkpoint / "grpo_fleet.json").read_text())["base_model"]
    model, tokenizer = mlx_lm.load(base, adapter_path=str(checkpoint))[:2]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    reply = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert isinstance(reply, str) and reply.strip(), reply
    # The model kept what it knew. Not the greedy reply's first words: after two steps of a batch this small, one run
    # in many opened with "L'Étoile, la Marseillaise," while it still gave " Paris" 0.96 of the next token here.
    ids = tokenizer.encode(prompt + "The capital of France is", add_special_tokens=False)
    probabilities = mx.softmax(model(mx.array([ids]))[0, -1].astype(mx.float32))
    best = int(mx.argmax(probabilities).item())
    assert tokenizer.decode([best]) == " Paris" and probabilities[best].item() > 0.5, (reply, tokenizer.decode([best]))
