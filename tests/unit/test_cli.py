"""The CLI's actor flags (unset ones take ActorConfig's defaults, and --help shows those), and its config errors."""

from __future__ import annotations

import pytest

from grpo_fleet.cli.main import actor_config, build_parser, main
from grpo_fleet.config import ActorConfig


def _actor(*flags: str) -> ActorConfig:
    return actor_config(build_parser().parse_args(["actor", "--connect", "tcp://10.0.0.7:5555", *flags]))


def test_an_actor_without_flags_is_the_config_models_default():
    assert _actor() == ActorConfig(connect="tcp://10.0.0.7:5555")


def test_one_metrics_flag_keeps_the_actors_other_metrics_default():
    cfg = _actor("--metrics-host", "0.0.0.0")
    assert (cfg.metrics.host, cfg.metrics.port) == ("0.0.0.0", ActorConfig().metrics.port)


def test_given_flags_reach_the_config():
    cfg = _actor("--max-groups", "4", "--request-timeout", "3", "--metrics-port", "0", "--model-dir", "a",
                 "--model-dir", "b", "--actor-id", "mac-1", "--key", "k.key_secret", "--learner-key", "learner.key")
    assert (cfg.max_groups, cfg.request_timeout, cfg.metrics.port, cfg.model_dirs) == (4, 3.0, 0, ["a", "b"])
    assert (cfg.actor_id, cfg.key_file, cfg.learner_key_file) == ("mac-1", "k.key_secret", "learner.key")


def test_help_shows_the_config_models_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["actor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    defaults = ActorConfig()
    assert f"prompts per lease (default {defaults.max_groups})" in text
    assert f"(default {defaults.request_timeout})" in text
    assert f"0 disables (default {defaults.metrics.port})" in text


def test_a_config_error_prints_the_key_and_the_fix_and_exits_2(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('[task]\nname = "reverse"\ndataset = "openai/gsm8k"\n[grpo]\ngroups_per_stepp = 4\n')
    assert main(["learner", "--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "task.dataset is set but task.name is 'reverse': set task.name = 'dataset'" in err
    assert "grpo.groups_per_stepp: not a known key" in err
    assert "Traceback" not in err and "pydantic" not in err and len(err.splitlines()) == 3, err


@pytest.mark.parametrize("argv", [
    ["learner", "--set", "grpo.groups_per_step=0"],  # a value out of range, in an override
    ["learner", "--set", "grpo"],  # an override that is not key=value
    ["actor", "--connect", "tcp://10.0.0.7:5555", "--max-groups", "0"],  # an actor flag
])
def test_every_configuration_mistake_is_one_message_and_exit_2(argv, tmp_path, capsys):
    assert main([*argv, *(["--run-dir", str(tmp_path / "run")] if argv[0] == "learner" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-fleet {argv[0]}: ") and "Traceback" not in err, err
