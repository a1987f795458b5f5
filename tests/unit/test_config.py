"""Tests for grpo_fleet.config: defaults, TOML/JSON loading, dotted overrides, strictness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from grpo_fleet.config import (
    ActorConfig,
    GRPOConfig,
    RunConfig,
    TaskConfig,
    apply_overrides,
    load_run_config,
    parse_override,
    toml_string,
)
from grpo_fleet.tasks import validate_rewards

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_CONFIGS = sorted((REPO_ROOT / "configs").glob("*.toml"))

SAMPLE_TOML = """\
run_dir = "runs/sample"

[model]
path = "tiny"

[model.tiny]
hidden_size = 32

[generation]
group_size = 4
max_tokens = 6
temperature = 0.7

[task]
name = "reverse"
digits = 2
num_train = 40
num_eval = 10

[grpo]
groups_per_step = 3
loss_type = "dapo"

[train]
steps = 12
"""


@pytest.fixture
def sample_toml(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(SAMPLE_TOML)
    return path


def test_defaults_validate_and_are_sensible():
    cfg = RunConfig()
    assert RunConfig.model_validate(cfg.model_dump()) == cfg
    assert cfg.model.path == "tiny"
    assert cfg.lora.enabled is False
    assert cfg.generation.group_size >= 2
    assert cfg.task.rewards == ["reverse_positions"]
    validate_rewards(cfg.task.rewards, cfg.task.reward_weights)
    assert load_run_config() == cfg


def test_actor_config_defaults_validate():
    cfg = ActorConfig()
    assert cfg.connect.startswith("tcp://")
    assert cfg.metrics.port == 9401
    assert cfg.model_dirs == []


def test_load_from_toml(sample_toml: Path):
    cfg = load_run_config(sample_toml)
    assert cfg.run_dir == "runs/sample"
    assert cfg.model.tiny.hidden_size == 32
    assert cfg.model.tiny.num_layers == 2  # untouched default inside a given section
    assert cfg.generation.group_size == 4
    assert cfg.generation.temperature == pytest.approx(0.7)
    assert cfg.task.digits == 2
    assert cfg.grpo.loss_type == "dapo"
    assert cfg.train.steps == 12
    assert cfg.optim == RunConfig().optim  # absent section: all defaults


def test_dotted_overrides_win_over_the_file(sample_toml: Path):
    cfg = load_run_config(
        sample_toml,
        [
            "train.steps=5",
            'server.bind="tcp://0.0.0.0:7000"',
            "task.name=jsonl",  # bare word: kept as a string
            "task.train_path=builtin:gsm8k_mini",  # bare word with a colon
            'task.rewards=["r1_format", "r1_accuracy"]',
            "task.reward_weights=[0.5, 1.0]",
            "optim.lr=3e-5",
            "lora.enabled=true",
            "metrics.port=0",
            "model.tiny.seed=7",  # nested section
        ],
    )
    assert cfg.train.steps == 5
    assert cfg.server.bind == "tcp://0.0.0.0:7000"
    assert cfg.task.name == "jsonl"
    assert cfg.task.train_path == "builtin:gsm8k_mini"
    assert cfg.task.rewards == ["r1_format", "r1_accuracy"]
    assert cfg.task.reward_weights == [0.5, 1.0]
    assert cfg.optim.lr == pytest.approx(3e-5)
    assert cfg.lora.enabled is True
    assert cfg.metrics.port == 0
    assert cfg.model.tiny.seed == 7
    assert cfg.model.tiny.hidden_size == 32  # sibling from the file survives
    assert cfg.generation.group_size == 4  # other sections untouched


def test_overrides_without_a_file_start_from_defaults():
    cfg = load_run_config(None, ["generation.group_size=3", "run_dir=out/x"])
    assert cfg.generation.group_size == 3
    assert cfg.run_dir == "out/x"
    assert cfg.generation.max_tokens == RunConfig().generation.max_tokens


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("train.steps=5", ["train", "steps"], 5),
        ("a.b=1.5", ["a", "b"], 1.5),
        ('server.bind="tcp://h:1"', ["server", "bind"], "tcp://h:1"),
        ("server.bind=tcp://h:1", ["server", "bind"], "tcp://h:1"),
        ("model.path=mlx-community/Qwen2.5-0.5B-Instruct-4bit", ["model", "path"], "mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
        ("lora.enabled=false", ["lora", "enabled"], False),
        ("task.rewards=['a', 'b']", ["task", "rewards"], ["a", "b"]),
        ("x=a=b", ["x"], "a=b"),
        (" train.seed =3", ["train", "seed"], 3),
    ],
)
def test_parse_override(text, path, value):
    got_path, got_value = parse_override(text)
    assert got_path == path
    assert got_value == value
    assert type(got_value) is type(value)


def test_override_without_equals_is_rejected():
    with pytest.raises(ValueError, match="key.path=value"):
        parse_override("train.steps")


def test_override_through_a_scalar_is_rejected():
    with pytest.raises(ValueError, match="not a section"):
        apply_overrides({"train": {"steps": 3}}, ["train.steps.deeper=1"])


def test_apply_overrides_does_not_mutate_its_input():
    data = {"train": {"steps": 3}}
    merged = apply_overrides(data, ["train.steps=9", "grpo.beta=0.0"])
    assert data == {"train": {"steps": 3}}
    assert merged == {"train": {"steps": 9}, "grpo": {"beta": 0.0}}


def test_unknown_override_key_is_rejected_with_its_name():
    with pytest.raises(ValidationError) as info:
        load_run_config(None, ["train.stepz=5"])
    text = str(info.value)
    assert "stepz" in text
    assert "Extra inputs are not permitted" in text


def test_unknown_section_in_toml_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text(SAMPLE_TOML + "\n[trainer]\nsteps = 3\n")
    with pytest.raises(ValidationError, match="trainer"):
        load_run_config(path)


def test_unknown_nested_key_in_toml_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.toml"
    path.write_text('[model.tiny]\nhidden = 32\n')
    with pytest.raises(ValidationError, match="hidden"):
        load_run_config(path)


def test_wrong_type_and_out_of_range_values_are_rejected():
    with pytest.raises(ValidationError, match="group_size"):
        load_run_config(None, ["generation.group_size=1"])
    with pytest.raises(ValidationError, match="loss_type"):
        load_run_config(None, ["grpo.loss_type=ppo"])
    with pytest.raises(ValidationError, match="steps"):
        load_run_config(None, ["train.steps=many"])


def test_assignment_is_validated_too():
    cfg = RunConfig()
    with pytest.raises(ValidationError):
        cfg.train.steps = 0
    with pytest.raises(ValidationError):
        cfg.train.unknown = 1  # type: ignore[attr-defined]


def test_reward_weights_length_mismatch_is_rejected():
    with pytest.raises(ValidationError, match="one entry per reward"):
        TaskConfig(rewards=["reverse_positions", "exact_match"], reward_weights=[1.0])
    with pytest.raises(ValidationError, match="one entry per reward"):
        load_run_config(None, ["task.reward_weights=[1.0, 2.0]"])
    ok = TaskConfig(rewards=["reverse_positions"], reward_weights=[2.0])
    assert ok.reward_weights == [2.0]


def test_jsonl_task_needs_a_train_path():
    with pytest.raises(ValidationError, match="train_path"):
        TaskConfig(name="jsonl")


def test_json_config_file_is_accepted(tmp_path: Path, sample_toml: Path):
    from_toml = load_run_config(sample_toml)
    path = tmp_path / "resolved.json"
    # mode="json" is what the learner writes to its run dir (tuples become lists).
    path.write_text(json.dumps(from_toml.model_dump(mode="json")))
    from_json = load_run_config(path, ["train.steps=2"])
    assert from_json.model_copy(update={"train": from_toml.train}) == from_toml
    assert from_json.train.steps == 2
    assert from_json.optim.betas == (0.9, 0.999)


def test_json_file_with_unknown_key_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"grpo": {"bta": 0.1}}))
    with pytest.raises(ValidationError, match="bta"):
        load_run_config(path)


@pytest.mark.parametrize(
    "config_path",
    REPO_CONFIGS or [pytest.param(None, marks=pytest.mark.skip(reason="no configs/*.toml in the repository yet"))],
    ids=[p.name for p in REPO_CONFIGS] or ["none"],
)
def test_repository_configs_load_and_validate(config_path: Path, monkeypatch: pytest.MonkeyPatch):
    from grpo_fleet.tasks import reward_module
    from grpo_fleet.tasks import rewards as registry

    cfg = load_run_config(config_path)
    assert isinstance(cfg, RunConfig)
    # Reward names must exist, not just parse; a reward file is relative to the checkout, where the learner starts.
    monkeypatch.chdir(config_path.parents[1])
    monkeypatch.setattr(registry, "REWARDS", dict(registry.REWARDS))
    monkeypatch.setattr(reward_module, "REWARDS", registry.REWARDS)
    validate_rewards(cfg.task.rewards, cfg.task.reward_weights, cfg.task.reward_module)


@pytest.mark.parametrize("text", ["runs/demo", 'a "quoted" dir', "C:\\runs\\x", "tcp://0.0.0.0:5555"])
def test_toml_string_survives_an_override_round_trip(text):
    assert parse_override(f"run_dir={toml_string(text)}") == (["run_dir"], text)


# ------------------------------------------------------------- the objective


def test_grpo_defaults_are_the_decoupled_objective_with_tis():
    grpo = GRPOConfig()
    assert (grpo.objective, grpo.is_mode, grpo.is_level, grpo.is_cap) == ("coupled", "truncate", "token", 2.0)
    assert grpo.dual_clip is None and grpo.mask_truncated is False and grpo.overlong_buffer == 0


@pytest.mark.parametrize("loss_type, low, high, want", [
    ("grpo", None, None, (0.2, 0.2)),
    ("dapo", None, 0.28, (0.2, 0.28)),
    ("dr_grpo", 0.1, None, (0.1, 0.1)),
    ("gspo", None, None, (3e-4, 4e-4)),
    ("gspo", 1e-3, None, (1e-3, 1e-3)),
    ("gspo", None, 1e-3, (3e-4, 1e-3)),
])
def test_clip_range_defaults_per_loss_type(loss_type, low, high, want):
    assert GRPOConfig(loss_type=loss_type, epsilon_low=low, epsilon_high=high).clip_range == pytest.approx(want)


@pytest.mark.parametrize("override", ["grpo.epsilon_low=0.2", "grpo.epsilon_high=0.28"])
def test_gspo_with_a_ppo_sized_clip_range_is_refused(override):
    with pytest.raises(ValidationError, match="geometric mean"):
        load_run_config(None, ["grpo.loss_type=gspo", override])
    # The same range is fine for a token-level loss.
    load_run_config(None, [override])


def test_dr_grpo_is_defined_without_the_std_division():
    assert GRPOConfig(loss_type="dr_grpo").scales_by_std is False
    assert GRPOConfig(loss_type="dr_grpo", scale_by_std=False).scales_by_std is False
    assert GRPOConfig().scales_by_std is True and GRPOConfig(scale_by_std=False).scales_by_std is False
    with pytest.raises(ValidationError, match="not Dr. GRPO"):
        load_run_config(None, ["grpo.loss_type=dr_grpo", "grpo.scale_by_std=true"])
    cfg = RunConfig()
    with pytest.raises(ValidationError, match="not Dr. GRPO"):
        cfg.grpo.loss_type = "dr_grpo"
        cfg.grpo.scale_by_std = True


@pytest.mark.parametrize("override, field", [
    ("grpo.is_cap=0.5", "is_cap"), ("grpo.is_mode=clip", "is_mode"), ("grpo.is_level=group", "is_level"),
    ("grpo.dual_clip=1.0", "dual_clip"), ("grpo.objective=ppo", "objective"), ("grpo.overlong_penalty=-1", "overlong"),
    ("grpo.epsilon_low=0", "epsilon_low"),
])
def test_bad_objective_settings_are_refused(override, field):
    with pytest.raises(ValidationError, match=field):
        load_run_config(None, [override])


def test_overlong_buffer_must_leave_room_below_max_tokens():
    ok = load_run_config(None, ["generation.max_tokens=16", "grpo.overlong_buffer=4"])
    assert ok.grpo.overlong_buffer == 4
    with pytest.raises(ValidationError, match="overlong_buffer"):
        load_run_config(None, ["generation.max_tokens=16", "grpo.overlong_buffer=16"])

