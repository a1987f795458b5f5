"""The config chooses the loss (grpo.loss): a built-in one, or a `Loss` of the user's own, and every one is checked."""

from __future__ import annotations

import textwrap

import pytest
from pydantic import ValidationError
from test_trainer import assert_checked_in_the_step, contrast_completions, on_policy_batch  # noqa: F401  (a fixture)

from grpo_fleet.config import BUILT_IN_LOSSES, GRPOConfig, RunConfig
from grpo_fleet.learner.step.fused_check import check_bounds_array
from grpo_fleet.learner.step.gap_bounds import GapBound
from grpo_fleet.learner.step.objective import GRPO_LOSS, LOSSES, loss_named
from grpo_fleet.learner.step.trainer import load_trainer

# A loss of the user's own, in a module of its own: the default objective, but it gives no policy logprobs (so the
# step's check must make them), and it counts its calls (so a test sees that the step ran this loss, not the default).
OWN_LOSS_MODULE = textwrap.dedent('''
    from grpo_fleet.learner.step.objective import Loss, LossOutput, default_loss

    calls = []

    def counted(model, micro, ref, totals, /, **settings):
        calls.append(micro.inputs.shape)
        out = default_loss(model, micro, ref, totals, **settings)
        return LossOutput(out.loss, {"own_kl": out.statistics["kl"]})

    COUNTED = Loss("counted", counted, gives_policy_logprobs=False)
    NOT_A_LOSS = counted
''')


@pytest.fixture
def own_losses(tmp_path, monkeypatch):
    """The module above, importable as `own_losses` for this test only."""
    (tmp_path / "own_losses.py").write_text(OWN_LOSS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "own_losses", raising=False)
    yield
    __import__("sys").modules.pop("own_losses", None)


def _config(model_dir, loss: str) -> RunConfig:
    return RunConfig.model_validate({"model": {"path": str(model_dir)}, "grpo": {"loss": loss, "beta": 0.0,
                                     "groups_per_step": 1}, "generation": {"max_tokens": 4}})


@pytest.mark.parametrize("name", ["gpro", "", "my.module", "my module:LOSS", "pkg.mod:not an identifier"])
def test_an_unknown_loss_name_is_refused_with_the_names_that_exist(name):
    with pytest.raises(ValidationError, match="unknown grpo.loss") as refused:
        GRPOConfig(loss=name)
    assert "grpo" in str(refused.value) and "package.module:NAME" in str(refused.value)


def test_the_config_names_the_built_in_losses_the_step_holds():
    assert GRPOConfig().loss == "grpo" and loss_named("grpo") is GRPO_LOSS
    assert sorted(LOSSES) == sorted(BUILT_IN_LOSSES), "config.BUILT_IN_LOSSES validates against objective.LOSSES"


def test_a_loss_of_ones_own_that_cannot_be_had_is_refused_by_name(own_losses):
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        loss_named("no_such_module:LOSS")
    with pytest.raises(ValueError, match="own_losses.NOT_A_LOSS is function, not a Loss"):
        loss_named("own_losses:NOT_A_LOSS")
    with pytest.raises(ValueError, match="own_losses.MISSING is NoneType, not a Loss"):
        loss_named("own_losses:MISSING")


def test_the_built_in_loss_the_config_names_trains_and_checks_from_its_own_forward(tiny_model_dir,
                                                                                    contrast_completions):  # noqa: F811
    trainer = load_trainer(_config(tiny_model_dir, "grpo"), str(tiny_model_dir))
    assert trainer.loss is GRPO_LOSS and "own forward" in trainer.loss.check_cost()
    batch = on_policy_batch(trainer.policy, *contrast_completions)
    batch.check = check_bounds_array([GapBound(0.001, 0.05)])
    stats = trainer.step(batch)
    assert stats.skipped is None and [c.broke for c in stats.checked] == [None]
    assert stats.proximal_seconds == 0.0, "its own logprobs are compared: no forward of the check's own"


def test_a_loss_the_config_names_by_module_reaches_the_step_and_is_checked(tiny_model_dir, own_losses,
                                                                          contrast_completions):  # noqa: F811
    """load_trainer is how rank 0 (learner/run/build.py) and every data-parallel rank (learner/ranks/follower.py)
    build their Trainer, so each trains the loss the config names."""
    trainer = load_trainer(_config(tiny_model_dir, "own_losses:COUNTED"), str(tiny_model_dir))
    import own_losses as module

    assert trainer.loss is module.COUNTED and "no-grad forward" in trainer.loss.check_cost()
    honest = on_policy_batch(trainer.policy, *contrast_completions)
    honest.check = check_bounds_array([GapBound(0.001, 0.05)])
    stats = trainer.step(honest)
    assert module.calls, "the step ran the loss the config named"
    assert stats.extra == {"own_kl": pytest.approx(0.0)} and stats.kl is None, "its statistics, and only those"
    assert stats.proximal_seconds > 0.0, "the check made its own forward for the logprobs this loss does not give"
    assert_checked_in_the_step(trainer, contrast_completions)  # checked: a lie drops the step
