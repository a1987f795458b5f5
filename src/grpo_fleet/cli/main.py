"""grpo-fleet command line. Parses arguments and imports the heavy parts lazily."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from grpo_fleet.cli.tools import add_tool_commands

if TYPE_CHECKING:
    from grpo_fleet.actor.worker import ActorWorker
    from grpo_fleet.config import ActorConfig, RunConfig
    from grpo_fleet.learner.run.coordinator import RunCoordinator


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _learner(args: argparse.Namespace) -> int:
    from grpo_fleet.config import load_run_config, toml_string
    from grpo_fleet.learner.door.doorman import InsecureBindError, check_bind_security
    from grpo_fleet.learner.ranks.collectives import launched_rank
    from grpo_fleet.learner.run.build import load_resume_config
    from grpo_fleet.runtime.exit_codes import REFUSED
    overrides = list(args.set or [])
    rank = launched_rank()  # under mlx.launch (a data-parallel learner); None for a plain process
    if rank is not None and rank > 0:
        return _learner_follower(rank, args, [o for o in overrides if o.startswith("distributed.")])
    if args.run_dir or args.resume:
        overrides.append(f"run_dir={toml_string(args.resume or args.run_dir)}")
    if args.bind:
        overrides.append(f"server.bind={toml_string(args.bind)}")
    if args.metrics_port is not None:
        overrides.append(f"metrics.port={args.metrics_port}")
    if args.metrics_host:
        overrides.append(f"metrics.host={toml_string(args.metrics_host)}")
    if args.keys:
        overrides.append(f"security.keys_dir={toml_string(args.keys)}")
    if args.insecure:
        overrides.append("security.insecure=true")
    if args.resume:
        cfg = load_resume_config(args.resume, overrides)
    else:
        cfg = load_run_config(args.config, overrides)
    try:
        check_bind_security(cfg)  # before loading a model that may take minutes
    except InsecureBindError as exc:
        print(f"grpo-fleet learner: {exc}", file=sys.stderr)
        return 2
    if rank is None:
        return _serve_learner(cfg, resume=bool(args.resume))
    from grpo_fleet.learner.ranks.distributed import connect, rank0_session
    from grpo_fleet.learner.ranks.ring_trust import RingRefused

    try:
        ranks = connect(cfg.distributed, rank, authenticated=bool(cfg.security.keys_dir))
        if ranks is None:  # `mlx.launch -n 1`: the plain learner
            return _serve_learner(cfg, resume=bool(args.resume))
        with rank0_session(ranks, cfg) as start:
            return _serve_learner(cfg, resume=bool(args.resume), ready=lambda learner: start(
                learner.trainer, learner.model_digest, learner.state.step, learner.metrics.registry))
    except RingRefused as exc:
        logging.getLogger("grpo_fleet.learner").error("%s", exc)
        return REFUSED


def _serve_learner(cfg: "RunConfig", *, resume: bool, ready: Optional[Callable[["RunCoordinator"], None]] = None) -> int:
    """Hold the run directory (one learner each: runtime/run_lock.py) while the learner is built and serves; a run
    directory or an address another process holds is refused in one line."""
    from grpo_fleet.protocol.endpoints import pub_endpoint_for
    from grpo_fleet.protocol.sockets import AddressInUse, check_bindable
    from grpo_fleet.runtime.run_lock import RunDirLock, RunDirLocked

    try:
        with RunDirLock(cfg.run_dir):
            check_bindable([cfg.server.bind, cfg.server.pub_bind or pub_endpoint_for(cfg.server.bind)])
            return _build_and_serve(cfg, resume=resume, ready=ready)
    except (RunDirLocked, AddressInUse) as exc:
        print(f"grpo-fleet learner: {exc}", file=sys.stderr)
        return 2


def _build_and_serve(cfg: "RunConfig", *, resume: bool, ready: Optional[Callable[["RunCoordinator"], None]]) -> int:
    """Build the learner (then `ready(learner)`: a data-parallel rank 0 starts its ranks) and serve the fleet."""
    from grpo_fleet.learner.door.server import LearnerServer
    from grpo_fleet.learner.records.runlog import ShortLog
    from grpo_fleet.learner.records.trackers import TrackerUnavailable
    from grpo_fleet.learner.run.build import build_learner
    from grpo_fleet.learner.step.memory import MemoryBudgetError
    from grpo_fleet.protocol.sockets import AddressInUse
    refusals: tuple[type[Exception], ...] = (MemoryBudgetError, TrackerUnavailable, ShortLog, *user_file_errors())
    try:
        learner = build_learner(cfg, resume=resume)
    except refusals as exc:
        logging.getLogger("grpo_fleet.learner").error("%s", exc)  # in learner.log too, not only the console
        print(f"grpo-fleet learner: {exc}", file=sys.stderr)
        return 2
    if ready is not None:
        ready(learner)
    server = LearnerServer(learner)
    server.install_signal_handlers()
    try:
        server.start_metrics()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise AddressInUse(f"metrics port {cfg.metrics.host}:{cfg.metrics.port} is already in use; choose another "
                           "with --metrics-port (0 disables it)") from None
    server.serve()
    return 0


def _learner_follower(rank: int, args: argparse.Namespace, overrides: list[str]) -> int:
    """A data-parallel rank > 0: everything but `distributed.*` comes from rank 0. Those it reads from the same
    config file as rank 0 when this machine has it (--config, or RUN_DIR/config.json on --resume), and --set."""
    from pathlib import Path

    from grpo_fleet.config import load_run_config
    from grpo_fleet.learner.ranks.distributed import connect
    from grpo_fleet.learner.ranks.follower import run_follower
    from grpo_fleet.learner.ranks.ring_trust import RingRefused
    from grpo_fleet.runtime.exit_codes import REFUSED

    path = args.config or (args.resume and str(Path(args.resume) / "config.json"))
    cfg = load_run_config(path if path and Path(path).is_file() else None, overrides).distributed
    try:
        ranks = connect(cfg, rank, authenticated=bool(cfg.key_file and cfg.learner_key_file))
    except RingRefused as exc:
        logging.getLogger("grpo_fleet.learner").error("%s", exc)
        return REFUSED
    return 0 if ranks is None else run_follower(ranks)


class _FromConfig:
    """The default of an actor flag: left to ActorConfig, whose field default `--help` shows.

    The config module is imported only when the help text is printed, so parsing stays light.
    """

    def __init__(self, field: str) -> None:
        self.field = field  # dotted, e.g. "metrics.port"

    def __str__(self) -> str:
        from grpo_fleet.config import ActorConfig

        value: object = ActorConfig()
        for part in self.field.split("."):
            value = getattr(value, part)
        return str(value)


def actor_config(args: argparse.Namespace) -> "ActorConfig":
    """The ActorConfig of `grpo-fleet actor ARGS`: the flags given, the model's defaults for the rest."""
    from grpo_fleet.config import ActorConfig

    def given(value: object) -> object:
        return None if isinstance(value, _FromConfig) else value

    fields = {"connect": args.connect, "actor_id": args.actor_id, "max_groups": given(args.max_groups),
              "env_concurrency": given(args.env_concurrency),
              "request_timeout": given(args.request_timeout), "model_dirs": args.model_dir,
              "reward_module": args.reward_module, "key_file": args.key, "learner_key_file": args.learner_key}
    data: dict[str, object] = {key: value for key, value in fields.items() if value is not None}
    metrics = {key: value for key, value in (("host", given(args.metrics_host)), ("port", given(args.metrics_port)))
               if value is not None}
    if metrics:
        # Over the actor's own metrics default (port 9401), not MetricsConfig's (the learner's 9400).
        data["metrics"] = {**ActorConfig().metrics.model_dump(), **metrics}
    return ActorConfig.model_validate(data)


def _actor(args: argparse.Namespace) -> int:
    """Exit codes (runtime/exit_codes.py): 0 the run is over, 2 refused for good (a launcher does not restart it)."""
    from grpo_fleet.actor.worker import ActorRefused, ActorWorker
    from grpo_fleet.runtime.exit_codes import DONE, REFUSED

    cfg = actor_config(args)
    try:
        worker = ActorWorker(cfg)
        if args.stdin_lifeline:
            _stop_with_stdin(worker, cfg.request_timeout)
        worker.run()
    except ActorRefused as exc:
        # One line, the last one: `grpo-fleet launch` shows it as the reason it stopped this actor.
        print(f"grpo-fleet actor: refusing to run: {exc}", file=sys.stderr)
        return REFUSED
    return DONE


def _stop_with_stdin(worker: ActorWorker, request_timeout: float) -> None:
    """--stdin-lifeline: stop the actor when stdin ends (actor/lifeline.py); not when stdin is /dev/null."""
    from grpo_fleet.actor.lifeline import stdin_is_watchable, watch_stdin

    if not stdin_is_watchable():
        print("grpo-fleet actor: --stdin-lifeline ignored: stdin is closed or /dev/null (ssh -n?)", file=sys.stderr)
        return

    def stop() -> None:
        if not worker.stopping:  # a signal may have asked first
            worker.request_stop()

    # The drain waits one request timeout at most for a learner that is gone; a little more, then stop now.
    watch_stdin(stop, grace=request_timeout + 10.0)


def user_file_errors() -> tuple[type[Exception], ...]:
    """A task's own files that cannot be used (its environment or reward module): the user's to fix, in one line."""
    from grpo_fleet.envs.process import EnvsRefused
    from grpo_fleet.learner.verify.env_replay import EnvNotVerifiable
    from grpo_fleet.tasks.env_module import EnvLoadError
    from grpo_fleet.tasks.reward_module import RewardModuleError

    return EnvNotVerifiable, EnvLoadError, EnvsRefused, RewardModuleError


def _demo(args: argparse.Namespace) -> int:
    from grpo_fleet.launch.demo import DemoOptions, run_demo
    from grpo_fleet.models.zoo import ZooError
    from grpo_fleet.runtime.run_lock import RunDirLocked

    options = DemoOptions(
        actors=args.actors, steps=args.steps, run_dir=args.run_dir,
        progress=not args.no_progress,
        config=args.config, overrides=list(args.set or []), model=args.model,
    )
    refusals: tuple[type[Exception], ...] = (ZooError, RunDirLocked, *user_file_errors())
    try:
        summary = run_demo(options)
    except refusals as exc:  # a learner already running in the run directory: nothing was deleted
        print(f"grpo-fleet demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the fleet was stopped in order on the way out (launch/local_fleet.py: running)
        print("grpo-fleet demo: interrupted; the learner and actors were stopped", file=sys.stderr)
        return 130
    return 0 if summary.get("ok", False) else 1


def _launch(args: argparse.Namespace) -> int:
    from grpo_fleet.config import config_error_message
    from grpo_fleet.launch.fleet_file import learner_run_config, load_fleet
    from grpo_fleet.launch.launcher import run_fleet

    try:
        fleet = load_fleet(args.fleet)
        resume = None if args.resume is None else (args.resume or learner_run_config(fleet.learner).run_dir)
    except (OSError, ValueError) as exc:  # a missing file, bad TOML, a schema or run-config error
        print(f"grpo-fleet launch: {args.fleet}: {config_error_message(exc) or exc}", file=sys.stderr)
        return 2
    return run_fleet(fleet, resume=resume)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-fleet", description="Distributed GRPO on MLX over ZeroMQ.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_fleet_commands(sub)
    add_tool_commands(sub)
    return parser


def _add_fleet_commands(sub: argparse._SubParsersAction) -> None:
    """The processes of a run: learner, actor, launch, demo."""
    learner = sub.add_parser("learner", help="run the learner (ROUTER server + MLX trainer)")
    learner.add_argument("--config", help="run config TOML (see configs/)")
    learner.add_argument("--run-dir", help="override run_dir")
    learner.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    learner.add_argument("--bind", help="override server.bind, e.g. tcp://0.0.0.0:5555")
    learner.add_argument("--metrics-port", type=int, help="override metrics.port (0 disables)")
    learner.add_argument("--metrics-host", help="override metrics.host (default 127.0.0.1)")
    learner.add_argument("--keys", metavar="DIR", help="CURVE keys directory (security.keys_dir)")
    learner.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE")
    learner.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted config override, repeatable")
    learner.set_defaults(func=_learner)

    actor = sub.add_parser("actor", help="run an actor; everything else comes from the learner")
    actor.add_argument("--connect", required=True, help="learner address, e.g. tcp://192.168.1.10:5555")
    actor.add_argument("--actor-id", help="name in logs and metrics (default host-pid)")
    actor.add_argument("--max-groups", type=int, default=_FromConfig("max_groups"),
                       help="prompts per lease (default %(default)s)")
    actor.add_argument("--env-concurrency", type=int, default=_FromConfig("env_concurrency"),
                       help="environment calls run at once (default %(default)s)")
    actor.add_argument("--request-timeout", type=float, default=_FromConfig("request_timeout"),
                       help="seconds without a reply before reconnecting (default %(default)s)")
    actor.add_argument("--metrics-host", default=_FromConfig("metrics.host"),
                       help="bind address of /metrics (default %(default)s)")
    actor.add_argument("--metrics-port", type=int, default=_FromConfig("metrics.port"),
                       help="port of /metrics, 0 disables (default %(default)s)")
    actor.add_argument("--key", help="this actor's CURVE secret key file (from `keys add-actor`)")
    actor.add_argument("--learner-key", help="the learner's public key file (learner.key)")
    actor.add_argument("--model-dir", action="append", help="local directory the learner's model may live in; repeatable")
    actor.add_argument("--reward-module", help="this machine's copy of the learner's task.reward_module (file or module)")
    actor.add_argument("--stdin-lifeline", action="store_true",
                       help="stop when stdin ends, as on SIGTERM: how `grpo-fleet launch` stops actors over ssh")
    actor.set_defaults(func=_actor)

    launch = sub.add_parser("launch", help="the learner here, every actor of a fleet file over ssh, restarted when they die")
    launch.add_argument("fleet", help="fleet file (TOML): ssh template, [learner], [[actors]]; see deploy/fleet.toml")
    launch.add_argument("--resume", nargs="?", const="", metavar="RUN_DIR",
                        help="continue the run from its latest checkpoint, as `learner --resume` does "
                        "(RUN_DIR defaults to the learner config's run_dir)")
    launch.set_defaults(func=_launch)

    demo = sub.add_parser("demo", help="learner + actors on this machine, tiny or --model, before/after eval")
    demo.add_argument("--actors", type=int, default=2)
    demo.add_argument("--steps", type=int, default=None, help="training steps (default from the demo config)")
    demo.add_argument("--run-dir", help="default: the config's run_dir, else runs/demo (runs/demo-real with --model)")
    demo.add_argument("--config", help="run config TOML (default configs/demo.toml settings)")
    demo.add_argument("--model", help="a pretrained zoo model (smollm2-135m-instruct, gemma3-270m): fetched, imported "
                                      "from GGUF and trained on its packaged task; --config replaces that task with yours")
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted config override, repeatable")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from grpo_fleet.runtime import transformers_scan
    from grpo_fleet.runtime.blas import reexec_with_openblas

    if argv is None:
        reexec_with_openblas()
    transformers_scan.install()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # pydantic's ValidationError is one
        from grpo_fleet.config import config_error_message  # lazily: only once something failed

        message = config_error_message(exc)
        if message is None:
            raise
        # The user's mistake is in a file or a flag: the message names the key and the fix; a traceback would bury it.
        print(f"grpo-fleet {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
