"""grpo-fleet command line. Parses arguments and imports the heavy parts lazily."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _learner(args: argparse.Namespace) -> int:
    from grpo_fleet.config import load_run_config
    from grpo_fleet.learner.server import LearnerServer
    from grpo_fleet.learner.setup import build_learner, load_resume_config
    from grpo_fleet.metrics import serve_metrics

    overrides = list(args.set or [])
    if args.run_dir or args.resume:
        overrides.append(f"run_dir={_toml_string(args.resume or args.run_dir)}")
    if args.bind:
        overrides.append(f"server.bind={_toml_string(args.bind)}")
    if args.metrics_port is not None:
        overrides.append(f"metrics.port={args.metrics_port}")
    if args.resume:
        cfg = load_resume_config(args.resume, overrides)
    else:
        cfg = load_run_config(args.config, overrides)
    learner = build_learner(cfg, resume=bool(args.resume))
    server = LearnerServer(learner)
    server.install_signal_handlers()
    serve_metrics(learner.metrics.registry, cfg.metrics.host, cfg.metrics.port)
    server.serve()
    return 0


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _actor(args: argparse.Namespace) -> int:
    from grpo_fleet.actor.worker import ActorWorker
    from grpo_fleet.config import ActorConfig, MetricsConfig

    cfg = ActorConfig(
        connect=args.connect,
        actor_id=args.actor_id,
        max_groups=args.max_groups,
        request_timeout=args.request_timeout,
        metrics=MetricsConfig(host=args.metrics_host, port=args.metrics_port),
    )
    ActorWorker(cfg).run()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from grpo_fleet.demo import DemoOptions, run_demo

    options = DemoOptions(
        actors=args.actors, steps=args.steps, run_dir=args.run_dir, progress=not args.no_progress,
        config=args.config, overrides=list(args.set or []),
    )
    summary = run_demo(options)
    return 0 if summary.get("ok", False) else 1


def _doctor(_args: argparse.Namespace) -> int:
    from grpo_fleet.doctor import report

    print(report())
    return 0


def _bench(_args: argparse.Namespace) -> int:
    print("grpo-fleet bench: benchmarks arrive with the speed work (issue D); nothing to run yet.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-fleet", description="Distributed GRPO on MLX over ZeroMQ.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    learner = sub.add_parser("learner", help="run the learner (ROUTER server + MLX trainer)")
    learner.add_argument("--config", help="run config TOML (see configs/)")
    learner.add_argument("--run-dir", help="override run_dir")
    learner.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    learner.add_argument("--bind", help="override server.bind, e.g. tcp://0.0.0.0:5555")
    learner.add_argument("--metrics-port", type=int, help="override metrics.port (0 disables)")
    learner.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted config override, repeatable")
    learner.set_defaults(func=_learner)

    actor = sub.add_parser("actor", help="run an actor; everything else comes from the learner")
    actor.add_argument("--connect", required=True, help="learner address, e.g. tcp://192.168.1.10:5555")
    actor.add_argument("--actor-id", help="name in logs and metrics (default host-pid)")
    actor.add_argument("--max-groups", type=int, default=2, help="prompts per lease")
    actor.add_argument("--request-timeout", type=float, default=30.0, help="seconds without a reply before reconnecting")
    actor.add_argument("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    actor.add_argument("--metrics-port", type=int, default=9401, help="port of /metrics (0 disables)")
    actor.set_defaults(func=_actor)

    demo = sub.add_parser("demo", help="learner + actors on this machine, tiny model, before/after eval")
    demo.add_argument("--actors", type=int, default=2)
    demo.add_argument("--steps", type=int, default=None, help="training steps (default from the demo config)")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--config", help="run config TOML (default configs/demo.toml settings)")
    demo.add_argument("--set", action="append", metavar="KEY=VALUE", help="dotted config override, repeatable")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)

    doctor = sub.add_parser("doctor", help="print the MLX backend, the BLAS in use and a matmul GF/s figure")
    doctor.set_defaults(func=_doctor)

    bench = sub.add_parser("bench", help="benchmarks (see bench/)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from grpo_fleet.blas import reexec_with_openblas

    if argv is None:
        reexec_with_openblas()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
