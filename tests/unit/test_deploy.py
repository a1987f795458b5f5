"""The deploy/ templates parse and say what the manual promises (docs/several-macs.md, docs/metrics.md): restart on
crash, the right flags, SD."""

from __future__ import annotations

import plistlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ACTOR_FLAGS = ("--connect", "--key", "--learner-key")


def test_launchd_plist() -> None:
    raw = (DEPLOY / "launchd" / "com.grpo-fleet.actor.plist").read_bytes()
    plist = plistlib.loads(raw)
    assert plist["Label"] == "com.grpo-fleet.actor"
    argv = plist["ProgramArguments"]
    assert argv[:2] == ["__GRPO_FLEET__", "actor"]
    for flag in ACTOR_FLAGS:
        assert flag in argv and not argv[argv.index(flag) + 1].startswith("--"), flag
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] is True or plist["KeepAlive"].get("SuccessfulExit") is False
    assert plist["StandardOutPath"].endswith("/Library/Logs/grpo-fleet-actor.log")
    assert plist["StandardErrorPath"] == plist["StandardOutPath"]
    # launchd expands neither ~ nor $VARS: every path must be a placeholder or absolute.
    for path in [argv[0], plist["WorkingDirectory"], plist["StandardOutPath"]]:
        assert path.startswith(("/", "__")), path
    text = raw.decode()
    placeholders = set(re.findall(r"__[A-Z_]+__", text.split("-->", 1)[1]))
    documented = set(re.findall(r"__[A-Z_]+__", text.split("-->", 1)[0]))
    assert placeholders <= documented, placeholders - documented
    assert "launchctl bootstrap gui/$(id -u) ~/Library/LaunchAgents/com.grpo-fleet.actor.plist" in text


def _unit_sections(text: str) -> dict[str, list[tuple[str, str]]]:
    """systemd unit syntax: [Section], Key=Value, `\\` continuation, # and ; comments, repeatable keys."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    logical = re.sub(r"\\\n\s*", " ", text)
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
            continue
        assert current is not None and "=" in line, line
        key, value = line.split("=", 1)
        sections[current].append((key.strip(), value.strip()))
    return sections


def test_systemd_unit() -> None:
    text = (DEPLOY / "systemd" / "grpo-fleet-actor.service").read_text()
    sections = _unit_sections(text)
    assert set(sections) == {"Unit", "Service", "Install"}
    service = dict(sections["Service"])
    assert service["Restart"] == "on-failure"
    # A permanent refusal (exit_codes.PERMANENT) is not restarted, as grpo-fleet launch does not restart it.
    from grpo_fleet.runtime.exit_codes import PERMANENT

    assert {int(code) for code in service["RestartPreventExitStatus"].split()} == PERMANENT
    assert int(service["RestartSec"]) > 0
    assert service["User"] and service["User"] != "root"
    env = [v for k, v in sections["Service"] if k == "Environment"]
    assert any(v.startswith("VIRTUAL_ENV=") for v in env)
    argv = service["ExecStart"].split()
    assert argv[0].startswith("__VENV__/") and argv[0].endswith("/grpo-fleet") and argv[1] == "actor"
    for flag in ACTOR_FLAGS:
        assert flag in argv and not argv[argv.index(flag) + 1].startswith("--"), flag
    assert dict(sections["Install"])["WantedBy"] == "multi-user.target"
    header = text.split("[Unit]", 1)[0]
    assert set(re.findall(r"__[A-Z_]+__", text)) <= set(re.findall(r"__[A-Z_]+__", header))


def test_prometheus_config() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    (job,) = config["scrape_configs"]
    (sd,) = job["http_sd_configs"]
    assert sd["url"] == "http://LEARNER_HOST:9400/sd"
    assert sd["refresh_interval"] == "15s"


def test_fleet_file_loads_as_the_launcher_reads_it() -> None:
    from grpo_fleet.launch.fleet_file import actor_command, learner_connect, load_fleet

    fleet = load_fleet(DEPLOY / "fleet.toml")
    assert "{host}" in fleet.ssh and "{command}" in fleet.ssh
    assert Path(fleet.learner.config).is_file()
    assert fleet.actors
    connect = learner_connect(fleet)
    for actor in fleet.actors:
        command = actor_command(fleet, actor, connect)
        assert command.count("--actor-id") == 1 and "--key" in command and "--learner-key" in command


def test_every_actor_of_the_shipped_fleet_file_has_what_its_run_requires() -> None:
    """The recipe's reward file needs --reward-module on every actor (or a workdir holding it); keys need keys."""
    from grpo_fleet.launch.fleet_file import actor_gaps, learner_run_config, load_fleet

    fleet = load_fleet(DEPLOY / "fleet.toml")
    run = learner_run_config(fleet.learner)
    assert run.task.reward_module and fleet.learner.keys, "the shipped fleet runs the recipe, with CURVE keys"
    assert actor_gaps(fleet, run) == []
    for actor in fleet.actors:
        flag = actor.args.index("--reward-module")
        assert actor.args[flag + 1].endswith(Path(run.task.reward_module).name), actor.name
        # No workdir: the path is resolved in the ssh login directory, so it must be absolute.
        assert actor.workdir or actor.args[flag + 1].startswith("/"), actor.name


def test_an_actor_without_the_reward_file_is_a_gap_named_before_launch() -> None:
    from grpo_fleet.launch.fleet_file import actor_gaps, learner_run_config, load_fleet

    fleet = load_fleet(DEPLOY / "fleet.toml")
    bare = [actor.model_copy(update={"args": [], "workdir": None}) for actor in fleet.actors]
    gaps = actor_gaps(fleet.model_copy(update={"actors": bare}), learner_run_config(fleet.learner))
    assert [gap.split(":", 1)[0] for gap in gaps] == [f"actor {actor.name}" for actor in fleet.actors]
    assert all("--reward-module" in gap for gap in gaps)
