"""The fleet file of `grpo-fleet launch` (see launch/launcher.py and deploy/fleet.toml), and the command lines it makes:
the learner's here, each actor's over ssh."""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from grpo_fleet.config import RunConfig, load_run_config, toml_string
from grpo_fleet.launch.policy import FIRST_BACKOFF_SECONDS
from grpo_fleet.protocol.endpoints import dialable
from grpo_fleet.tasks.reward_module import is_module_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_SSH = "ssh -o BatchMode=yes {host} {command}"


# --------------------------------------------------------------------------- fleet file


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LearnerSpec(_Section):
    """The learner, started on this machine as `python -m grpo_fleet learner`."""

    config: str = Field(description="Run config file (TOML or JSON); relative to the fleet file's directory.")
    keys: Optional[str] = Field(None, description="CURVE keys directory (`--keys`); relative to the fleet file's directory.")
    args: list[str] = Field(default_factory=list, description="Extra learner flags, e.g. ['--metrics-host', '0.0.0.0'].")
    connect: Optional[str] = Field(
        None,
        description="Address the actors dial. Default: the config's server.bind (after --bind/--set in args), "
        "with a wildcard host replaced by this machine's hostname.",
    )


class ActorSpec(_Section):
    """One actor process on one host, started through the ssh template."""

    host: str = Field(min_length=1, description="Host name given to the ssh template's {host}: one word, not an option.")
    id: Optional[str] = Field(None, description="--actor-id and the output prefix; default: host. Unique in the fleet.")
    key: Optional[str] = Field(None, description="Path on that host to this actor's CURVE secret key (NAME.key_secret); "
                               "a leading ~/ is the remote home.")
    learner_key: Optional[str] = Field(None, description="Path on that host to the learner's public key (learner.key); "
                                       "a leading ~/ is the remote home.")
    workdir: Optional[str] = Field(None, description="Directory on that host to cd into first (relative to the remote "
                                   "home, or a leading ~/).")
    args: list[str] = Field(default_factory=list, description="Extra actor flags, e.g. ['--model-dir', 'models']; "
                            "passed as they are (a ~ in them is not expanded).")

    @field_validator("host")
    @classmethod
    def _host_is_not_an_option(cls, host: str) -> str:
        # ssh would read `-oProxyCommand=...` as an option and run its command here.
        if host.startswith("-"):
            raise ValueError(f"host {host!r} starts with '-': ssh would take it for an option")
        if any(c.isspace() or not c.isprintable() for c in host):
            raise ValueError(f"host {host!r} holds whitespace or control characters: it must be one word")
        return host

    @model_validator(mode="after")
    def _keys_in_pairs(self) -> "ActorSpec":
        # The actor refuses to run with only one of them; say so here, not after a restart loop.
        if (self.key is None) != (self.learner_key is None):
            raise ValueError(f"actor {self.name}: key and learner_key go together")
        return self

    @property
    def name(self) -> str:
        """The actor id: what it is called in the learner's logs and in our output."""
        return self.id or self.host


class FleetConfig(_Section):
    """A whole fleet: how to reach the hosts, the learner, the actors."""

    ssh: str = Field(
        DEFAULT_SSH,
        description="Command template that runs {command} (one shell-quoted argument) on {host}.",
    )
    grpo_fleet: str = Field(
        "grpo-fleet", min_length=1,
        description="The grpo-fleet command on the remote hosts, inserted unquoted (e.g. '.venv/bin/grpo-fleet').",
    )
    learner: LearnerSpec = Field(description="The learner run on this machine.")
    actors: list[ActorSpec] = Field(min_length=1, description="One entry per actor process.")
    restart_backoff_max: float = Field(
        30.0, ge=FIRST_BACKOFF_SECONDS, description="Longest wait, in seconds, before restarting an actor."
    )
    stop_timeout: float = Field(
        30.0, gt=0, description="Seconds processes get after SIGTERM (the learner checkpoints) before SIGKILL."
    )

    @field_validator("ssh")
    @classmethod
    def _template_works(cls, template: str) -> str:
        if "{command}" not in template:
            raise ValueError("the ssh template needs a {command} placeholder")
        try:
            ssh_argv(template, "host", "true")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"bad ssh template {template!r}: only {{host}} and {{command}} may appear ({exc})") from exc
        return template

    @model_validator(mode="after")
    def _unique_ids(self) -> "FleetConfig":
        # The actor id is its ZeroMQ identity: two live actors with one id would take over each other's connection.
        names = [actor.name for actor in self.actors]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"actor ids must be unique; set `id` for the repeated ones: {duplicates}")
        return self


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and validate a fleet file; local paths in it are taken relative to its directory.

    The learner's run config is loaded too, so its errors show before anything starts.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        cfg = FleetConfig.model_validate(tomllib.load(handle))
    base = path.resolve().parent
    learner = cfg.learner
    resolved = learner.model_copy(update={
        "config": str(base / Path(learner.config).expanduser()),
        "keys": str(base / Path(learner.keys).expanduser()) if learner.keys else None,
    })
    _learner_bind(resolved)
    return cfg.model_copy(update={"learner": resolved})


def actor_gaps(cfg: FleetConfig, run: RunConfig) -> list[str]:
    """What an actor's entry lacks for this run, one line per actor and gap: each is a refusal waiting to happen.

    The run's reward file (task.reward_module) is run from each actor's own copy,
    which it finds by --reward-module, or, for a file, by the same relative path in
    its workdir (or a --model-dir). A learner with CURVE keys admits only actors with keys.
    """
    gaps = []
    module = run.task.reward_module
    for actor in cfg.actors:
        found_by_path = module is not None and not is_module_name(module) and (
            (actor.workdir is not None and not Path(module).is_absolute()) or "--model-dir" in actor.args)
        if module is not None and "--reward-module" not in actor.args and not found_by_path:
            gaps.append(f"actor {actor.name}: the run's rewards are in {module!r} (task.reward_module); add "
                        f'"--reward-module", "PATH of its copy on {actor.host}" to its args, or it refuses the run')
        if (cfg.learner.keys or run.security.keys_dir) and actor.key is None:
            gaps.append(f"actor {actor.name}: the learner admits only actors with CURVE keys; set its key and learner_key")
    return gaps


# --------------------------------------------------------------------------- commands


def ssh_argv(template: str, host: str, command: str) -> list[str]:
    """The local argv that runs `command` on `host`: the command travels as one quoted word.

    For ssh itself, `--` goes before the host word when the template has none, so
    that no host can be read as an option (fleet files also refuse a host that
    starts with '-').
    """
    words = shlex.split(template.format(host=_HOST_MARK, command=shlex.quote(command)))
    at = next((i for i, word in enumerate(words) if _HOST_MARK in word), None)
    if at is not None and words and Path(words[0]).name == "ssh" and "--" not in words[:at]:
        words.insert(at, "--")
    return [word.replace(_HOST_MARK, host) for word in words]


_HOST_MARK = "GRPO-FLEET-HOST"  # a word shlex keeps whole, put back after the split


def _remote_path(path: str) -> str:
    """Quote a path for the remote shell, but keep a leading ~/ (the remote home) expandable there."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return "~/" + shlex.quote(rest) if rest else "~"
    return shlex.quote(path)


def actor_command(cfg: FleetConfig, actor: ActorSpec, connect: str) -> str:
    """The shell command an actor's host runs: `[cd WORKDIR &&] GRPO_FLEET actor ...`."""
    # --stdin-lifeline: ssh forwards the end of its stdin, which launch holds; that is how the actor is stopped.
    words = ["actor", "--connect", shlex.quote(connect), "--actor-id", shlex.quote(actor.name), "--stdin-lifeline"]
    if actor.key and actor.learner_key:
        words += ["--key", _remote_path(actor.key), "--learner-key", _remote_path(actor.learner_key)]
    words += [shlex.quote(arg) for arg in actor.args]
    # grpo_fleet stays unquoted: it may be several words ("~/venv/bin/python -m grpo_fleet").
    command = " ".join([cfg.grpo_fleet, *words])
    return f"cd {_remote_path(actor.workdir)} && {command}" if actor.workdir else command


def learner_argv(cfg: FleetConfig, resume: Optional[str] = None) -> list[str]:
    """The local learner command; this interpreter, so it runs the same installation.

    `resume` is a run directory to continue from its latest checkpoint (the learner's `--resume`).
    """
    start = ["--resume", resume] if resume is not None else ["--config", cfg.learner.config]
    argv = [sys.executable, "-m", "grpo_fleet", "learner", *start]
    if cfg.learner.keys:
        argv += ["--keys", cfg.learner.keys]
    return argv + list(cfg.learner.args)


def learner_connect(cfg: FleetConfig, resume: Optional[str] = None) -> str:
    """Where actors dial: `learner.connect`, or the learner's bind with a wildcard made reachable."""
    if cfg.learner.connect:
        return cfg.learner.connect
    return dialable(learner_run_config(cfg.learner, resume).server.bind, socket.gethostname())


def learner_run_config(learner: LearnerSpec, resume: Optional[str] = None) -> RunConfig:
    """The run config the learner will use: its file (RUN_DIR/config.json when resuming) plus its flags."""
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags.add_argument("--bind")
    flags.add_argument("--run-dir")
    flags.add_argument("--set", action="append", default=[])
    known, _ = flags.parse_known_args(learner.args)
    overrides = list(known.set) + ([f"server.bind={toml_string(known.bind)}"] if known.bind else [])
    run_dir = resume or known.run_dir
    if run_dir:
        overrides.append(f"run_dir={toml_string(run_dir)}")
    return load_run_config(Path(resume) / "config.json" if resume else learner.config, overrides)


def _learner_bind(learner: LearnerSpec) -> str:
    return learner_run_config(learner).server.bind
