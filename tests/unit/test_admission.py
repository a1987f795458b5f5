"""What an actor agrees to run: every refusal, and what it loads when it accepts. No sockets, no model."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_fleet.actor import admission
from grpo_fleet.actor.admission import ActorRefused, admit, model_key, model_path_allowed
from grpo_fleet.config import LoraConfig
from grpo_fleet.models.gguf.importer import GGUFError
from grpo_fleet.protocol import messages as m

DIGEST = "ab" * 32


def _welcome(path: str, *, rewards: tuple[str, ...] = ("exact_match",), top_p: float = 1.0,
             dtype: str | None = None, lora: dict | None = None, digest: str = DIGEST) -> m.Welcome:
    return m.Welcome(
        run_id="r", actor_id="a", model=m.ModelRef(path=path, digest=digest, lora=lora, dtype=dtype),
        generation=m.GenerationParams(group_size=2, max_tokens=2, temperature=1.0, top_p=top_p),
        reward=m.RewardSpec(names=list(rewards), weights=[1.0] * len(rewards)),
        policy_version=0, heartbeat_seconds=1.0, vocab_size=10,
    )


def _digest_of(expected: dict[str, str]):
    """A stand-in for `model_digest`: the digest each local path would hash to."""
    return lambda path: expected[path]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    return path


def test_an_allowed_model_with_the_learners_digest_is_admitted(model_dir: Path) -> None:
    lora = {"enabled": True, "rank": 4}
    welcome = _welcome(str(model_dir), lora=lora, dtype="bfloat16")
    plan = admit(welcome, [str(model_dir.parent)], digest=_digest_of({str(model_dir): DIGEST}))
    assert plan is not None
    assert plan.path == str(model_dir) and plan.dtype == "bfloat16"
    assert plan.lora == LoraConfig(enabled=True, rank=4)
    assert plan.key == model_key(welcome.model)


def test_full_weights_and_the_default_dtype_are_admitted(model_dir: Path) -> None:
    plan = admit(_welcome(str(model_dir)), [str(model_dir.parent)], digest=_digest_of({str(model_dir): DIGEST}))
    assert plan is not None and plan.lora is None and plan.dtype is None


def test_the_model_already_loaded_is_not_loaded_again(model_dir: Path) -> None:
    welcome = _welcome(str(model_dir))

    def never(path: str) -> str:
        raise AssertionError("the digest of a loaded model is not recomputed")

    assert admit(welcome, [str(model_dir.parent)], loaded=model_key(welcome.model), digest=never) is None


def test_a_change_of_adapters_or_dtype_is_another_model(model_dir: Path) -> None:
    loaded = model_key(_welcome(str(model_dir)).model)
    digest = _digest_of({str(model_dir): DIGEST})
    assert admit(_welcome(str(model_dir), dtype="float16"), [str(model_dir.parent)], loaded, digest) is not None
    assert admit(_welcome(str(model_dir), lora={"rank": 2}), [str(model_dir.parent)], loaded, digest) is not None


def test_an_unknown_reward_is_refused(model_dir: Path) -> None:
    with pytest.raises(ActorRefused, match="reward this actor does not have"):
        admit(_welcome(str(model_dir), rewards=("exact_match", "run_this_code")), [str(model_dir.parent)])


def test_nucleus_sampling_is_refused(model_dir: Path) -> None:
    with pytest.raises(ActorRefused, match="top_p=0.9"):
        admit(_welcome(str(model_dir), top_p=0.9), [str(model_dir.parent)])


@pytest.mark.parametrize("dtype", ["eval", "int8", "float64"])
def test_a_dtype_no_config_can_name_is_refused(model_dir: Path, dtype: str) -> None:
    with pytest.raises(ActorRefused, match="dtype"):
        admit(_welcome(str(model_dir), dtype=dtype), [str(model_dir.parent)])


def test_a_model_outside_the_allowed_dirs_is_refused(model_dir: Path) -> None:
    with pytest.raises(ActorRefused, match="outside the allowed directories"):
        admit(_welcome("/etc/passwd"), [str(model_dir.parent)])


def test_the_refusals_come_before_any_digest_is_computed(model_dir: Path) -> None:
    def never(path: str) -> str:
        raise AssertionError("refused before hashing")

    for welcome in (_welcome(str(model_dir), rewards=("nope",)), _welcome("/etc/passwd")):
        with pytest.raises(ActorRefused):
            admit(welcome, [str(model_dir.parent)], digest=never)


def test_a_local_copy_with_another_digest_is_refused(model_dir: Path) -> None:
    with pytest.raises(ActorRefused, match="digest mismatch"):
        admit(_welcome(str(model_dir)), [str(model_dir.parent)], digest=_digest_of({str(model_dir): "cd" * 32}))


def test_the_digest_is_computed_over_the_real_files(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"weights")
    from grpo_fleet.models.loading import model_digest

    plan = admit(_welcome(str(model_dir), digest=model_digest(str(model_dir))), [str(model_dir.parent)])
    assert plan is not None and plan.path == str(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ActorRefused, match="digest mismatch"):
        admit(_welcome(str(model_dir), digest=plan.key[1]), [str(model_dir.parent)])


def test_a_realshape_model_is_loaded_from_this_machines_own_copy(monkeypatch, tmp_path: Path) -> None:
    built = tmp_path / "cache" / "qwen2.5-0.5b-l2-s0-bf16-v1"
    learner_path = f"/Users/learner/.cache/grpo-fleet/models/{built.name}"  # not on this machine
    monkeypatch.setattr(admission, "local_copy", lambda path: built if path == learner_path else None)
    plan = admit(_welcome(learner_path), [], digest=_digest_of({str(built): DIGEST}))
    assert plan is not None and plan.path == str(built)


def test_hub_ids_are_allowed_and_local_paths_must_stay_in_allowed_dirs(tmp_path: Path) -> None:
    allowed = tmp_path / "models"
    (allowed / "tiny").mkdir(parents=True)
    assert model_path_allowed("mlx-community/Qwen2.5-0.5B-Instruct-4bit", [str(allowed)])
    assert model_path_allowed(str(allowed / "tiny"), [str(allowed)])
    assert not model_path_allowed(str(allowed / ".." / "elsewhere"), [str(allowed)])
    assert not model_path_allowed("/etc", [str(allowed)])
    link = allowed / "sneaky"
    link.symlink_to("/etc")
    assert not model_path_allowed(str(link), [str(allowed)])


def test_without_model_dirs_the_working_directory_is_the_allowed_one(monkeypatch, tmp_path: Path) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_path_allowed(str(tmp_path / "here"), [])
    assert not model_path_allowed(str(tmp_path.parent), [])


# ---------------------------------------------------------------- the user's reward module


def _reward_spec(module: str, digest: str) -> m.RewardSpec:
    return m.RewardSpec(names=["mine"], weights=[1.0], module=module, module_digest=digest, timeout_seconds=3.0,
                        bound=100.0)


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "learner" / "my_rewards.py"
    path.parent.mkdir()
    path.write_text("def mine(completion, prompt, **columns):\n    return 1.0\n")
    return path


def test_a_reward_module_is_imported_only_with_consent(reward_file: Path, tmp_path: Path) -> None:
    from grpo_fleet.tasks.reward_module import module_digest

    spec = _reward_spec(str(reward_file), module_digest(str(reward_file)))
    with pytest.raises(ActorRefused, match="--reward-module"):
        admission.plan_rewards(spec, None, [str(tmp_path / "elsewhere")])
    inside = admission.plan_rewards(spec, None, [str(reward_file.parent)])
    assert inside.module == str(reward_file) and (inside.timeout_seconds, inside.bound) == (3.0, 100.0)
    copy = tmp_path / "actor_copy.py"
    copy.write_bytes(reward_file.read_bytes())
    assert admission.plan_rewards(spec, str(copy), []).module == str(copy), "this Mac's own copy, same bytes"


def test_a_reward_module_that_differs_or_is_missing_refuses_the_run(reward_file: Path, tmp_path: Path) -> None:
    from grpo_fleet.tasks.reward_module import module_digest

    spec = _reward_spec(str(reward_file), module_digest(str(reward_file)))
    changed = tmp_path / "changed.py"
    changed.write_text("def mine(completion, prompt, **columns):\n    return 0.0\n")
    with pytest.raises(ActorRefused, match="differs from the learner's"):
        admission.plan_rewards(spec, str(changed), [])
    with pytest.raises(ActorRefused, match="cannot read its reward module.*no such file"):
        admission.plan_rewards(spec, str(tmp_path / "absent.py"), [])
    with pytest.raises(ActorRefused, match="--reward-module"):
        admission.plan_rewards(_reward_spec("some_module", spec.module_digest or ""), None, [str(tmp_path)])


def test_built_in_rewards_need_no_module() -> None:
    spec = m.RewardSpec(names=["exact_match"], weights=[2.0])
    rewards = admission.plan_rewards(spec, None, [])
    assert rewards.module is None and rewards.weights == (2.0,)


def test_a_gguf_outside_the_allowed_dirs_is_refused_before_any_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    monkeypatch.setattr(admission, "import_source", lambda path, cache: imported.append(path) or tmp_path)
    outside = tmp_path / "elsewhere" / "model.gguf"
    with pytest.raises(ActorRefused, match="outside the allowed directories"):
        admission.local_model_path(str(outside), [str(tmp_path / "allowed")])
    assert imported == []


def test_a_gguf_is_imported_into_this_machines_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "default_cache_dir", lambda: tmp_path / "cache")
    calls: list[tuple[str, Path]] = []
    monkeypatch.setattr(admission, "import_source", lambda path, cache: calls.append((path, cache)) or cache / "imported")
    inside = tmp_path / "models" / "model.gguf"
    assert admission.local_model_path(str(inside), [str(tmp_path / "models")]) == str(tmp_path / "cache" / "imported")
    # A zoo model is pinned by its digest, so it needs no --model-dir.
    assert admission.local_model_path("zoo:smollm2-135m-instruct", []) == str(tmp_path / "cache" / "imported")
    assert calls == [(str(inside), tmp_path / "cache"), ("zoo:smollm2-135m-instruct", tmp_path / "cache")]


def test_a_gguf_that_cannot_be_imported_refuses_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: str, cache: Path) -> Path:
        raise GGUFError("tensor 'blk.0.attn_q.weight' has type Q4_K, which MLX cannot read (llama model)")

    monkeypatch.setattr(admission, "import_source", broken)
    with pytest.raises(ActorRefused, match="cannot import the learner's model .*Q4_K"):
        admission.local_model_path("zoo:smollm2-135m-instruct", [])
