"""grpo-fleet's tools around a run (status, keys, doctor, build-model, import-gguf, bench, plot, samples): their
arguments and what each runs. Like cli/main.py, it imports the heavy parts lazily."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _keys(args: argparse.Namespace) -> int:
    from grpo_fleet.protocol import auth

    if args.keys_command == "init":
        public = auth.init_keys(args.dir)
        print(f"learner keypair in {args.dir}; copy {public} to every actor Mac")
    elif args.keys_command == "add-actor":
        secret = auth.add_actor(args.dir, args.name)
        print(f"actor {args.name} allowed. Copy {secret} and {args.dir}/learner.key to that Mac, then run:\n"
              f"  grpo-fleet actor --connect tcp://LEARNER:5555 --key {secret.name} --learner-key learner.key\n"
              f"and delete {secret} here.")
    elif args.keys_command == "add-rank":
        secret = auth.add_rank(args.dir, args.name)
        print(f"learner rank {args.name} allowed at the ring door. Copy {secret} and {args.dir}/learner.key to that "
              f"Mac, and set there\n  distributed.key_file = \"{secret.name}\"\n"
              f"  distributed.learner_key_file = \"learner.key\"")
    elif args.keys_command == "add-observer":
        secret = auth.add_observer(args.dir, args.name)
        print(f"observer {args.name} allowed to ask Status only. Run:\n"
              f"  grpo-fleet status --connect tcp://LEARNER:5555 --key {secret} --learner-key {args.dir}/learner.key")
    elif args.keys_command == "revoke":
        found = auth.revoke_actor(args.dir, args.name)
        print(f"{args.name} {'revoked; a running learner drops it within seconds' if found else 'was not allowed'}")
        return 0 if found else 1
    return 0


def _doctor(_args: argparse.Namespace) -> int:
    from grpo_fleet.runtime.doctor import report

    print(report())
    return 0


def _build_model(args: argparse.Namespace) -> int:
    import time

    from grpo_fleet.models.realshape import build_realshape

    start = time.perf_counter()
    try:
        path = build_realshape(args.spec, args.cache_dir)
    except ValueError as exc:
        print(f"grpo-fleet build-model: {exc}", file=sys.stderr)
        return 2
    print(f"{path}  ({_built(path, start)})")
    return 0


def _built(path: Path, started: float) -> str:
    """A built model directory's size and how long it took since `started` (perf_counter)."""
    import time

    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return f"{size / 1e6:.0f} MB, {time.perf_counter() - started:.1f} s"


def _import_gguf(args: argparse.Namespace) -> int:
    import time

    from grpo_fleet.models.gguf.importer import GGUFError, import_gguf
    from grpo_fleet.models.zoo import ZooError, gguf_file

    start = time.perf_counter()
    try:
        path = import_gguf(gguf_file(args.file), args.out_dir, dtype=args.dtype, force=args.force)
    except (GGUFError, ZooError, OSError) as exc:
        print(f"grpo-fleet import-gguf: {exc}", file=sys.stderr)
        return 2
    print(f"{path}  ({_built(path, start)}); load it with mlx_lm.load({str(path)!r})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from grpo_fleet.export.run import ExportError, ExportRequest, export_run
    from grpo_fleet.models.gguf.importer import GGUFError

    request = ExportRequest(path=args.run, out=args.out, step=args.step, gguf=args.gguf, ollama=args.ollama)
    try:
        result = export_run(request)
    except (ExportError, GGUFError, OSError) as exc:
        print(f"grpo-fleet export: {exc}", file=sys.stderr)
        return 2
    print(result.describe())
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    from grpo_fleet.export.names import GGUF_TYPES

    export = sub.add_parser("export", help="fuse a run's adapters into its model: an mlx-lm directory and a GGUF for "
                            "llama.cpp, LM Studio and Ollama")
    export.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT", help="a run directory (its latest checkpoint) or a "
                        "checkpoint directory")
    export.add_argument("--step", type=int, help="the checkpoint of this step in RUN_DIR")
    export.add_argument("--out", required=True, metavar="DIR", help="where to write mlx/, the GGUF and the Modelfile")
    export.add_argument("--gguf", choices=GGUF_TYPES, help="the GGUF's type (default q8_0 for a model imported from a "
                        "GGUF; q4_k_m needs llama.cpp's quantizer)")
    export.add_argument("--ollama", metavar="NAME", help="also write a Modelfile and print the `ollama create NAME` command")
    export.set_defaults(func=_export)


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpo_fleet.bench import Scale, run_benchmarks

    names = [n.strip() for n in args.only.split(",")] if args.only else None
    scale = Scale.QUICK if args.quick else Scale.FULL if args.full else Scale.DEFAULT
    run_benchmarks(names, scale, Path(args.out))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpo_fleet.observe.plotting import RunDataError, plot_run

    try:
        out = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except RunDataError as exc:
        print(f"grpo-fleet plot: {exc}", file=sys.stderr)
        return 1
    print(f"curves written to {out}")
    return 0


def _samples(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from grpo_fleet.observe.samples_view import SamplesError, format_samples, read_last_rows

    try:
        read = read_last_rows(Path(args.run_dir), args.last)
    except SamplesError as exc:
        print(f"grpo-fleet samples: {exc}", file=sys.stderr)
        return 2
    if read.skipped:
        print(f"grpo-fleet samples: skipped {read.skipped} incomplete line(s)", file=sys.stderr)
    print(format_samples(read, width=shutil.get_terminal_size((100, 24)).columns, max_chars=args.max_chars))
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grpo_fleet.launch.policy import format_refusals, read_refusals
    from grpo_fleet.protocol.client import format_status, request_status

    try:
        status = request_status(args.connect, key_file=args.key, learner_key_file=args.learner_key, timeout_s=args.timeout)
    except (TimeoutError, RuntimeError, ValueError) as exc:
        print(f"grpo-fleet status: {exc}", file=sys.stderr)
        return 1
    print(format_status(status))
    if args.run_dir:
        print(format_refusals(read_refusals(Path(args.run_dir))))
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from grpo_fleet.simulator.lengths import parse_lengths
    from grpo_fleet.simulator.plan import PlanInputs, PlanShape, plan, plan_lengths, render, render_lengths, render_on_off
    from grpo_fleet.simulator.published import MODELS
    from grpo_fleet.simulator.specs import FleetRules

    if args.model not in MODELS or args.mac not in MODELS[args.model].decode_tok_s:
        print(f"grpo-fleet simulate: choose --model from {', '.join(MODELS)} and --mac from "
              f"{', '.join(next(iter(MODELS.values())).decode_tok_s)}", file=sys.stderr)
        return 2
    given = {"check_share": args.check_share, "check_completions": args.check_completions}
    inputs = PlanInputs(model=args.model, mac=args.mac, batch_speedup=args.batch_speedup,
                        learner_tok_s=args.learner_tok_s, link_gbps=args.link_gbps,
                        logprob_check=not args.no_logprob_check, padding=args.padding,
                        **{k: v for k, v in given.items() if v is not None})
    shape = PlanShape(group_size=args.group_size, prompt_tokens=args.prompt_tokens,
                      completion_tokens=args.completion_tokens, rules=FleetRules(groups_per_step=args.groups_per_step))
    if args.lengths:  # drawn lengths: refilled rows or not, at the first --ranks (Markdown, docs/simulator.md's)
        try:
            shape = replace(shape, lengths=parse_lengths(args.lengths, args.completion_tokens))
        except ValueError as exc:
            print(f"grpo-fleet simulate: {exc}", file=sys.stderr)
            return 2
        print(render_lengths(plan_lengths(inputs, shape, args.actors, args.ranks[0]), inputs, shape, args.ranks[0]))
        return 0
    result = plan(inputs, shape, args.actors, args.ranks)
    if args.on_off:  # the same fleet with verification on and off, as a Markdown table (docs/simulator.md's)
        print(render_on_off(result, plan(replace(inputs, logprob_check=False), shape, args.actors, args.ranks)))
        return 0
    print(render(result, inputs, shape))
    return 0


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1, got {text}")
    return value


def _counts(text: str) -> list[int]:
    return [_at_least_one(part) for part in text.split(",")]


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    simulate = sub.add_parser("simulate", help="model how many Macs and learner ranks a run can use (not a measurement)")
    simulate.add_argument("--model", default="qwen2.5-0.5b", help="a size from grpo_fleet.simulator.published")
    simulate.add_argument("--mac", default="m5-max", help="the actors' Mac: m1-ultra or m5-max (published tok/s)")
    simulate.add_argument("--actors", type=_counts, default=[1, 2, 4, 8, 16, 32, 64], help="e.g. 1,2,4,8")
    simulate.add_argument("--ranks", type=_counts, default=[1, 2, 4], help="learner rank counts, e.g. 1,2,4")
    simulate.add_argument("--learner-tok-s", type=float, default=None,
                          help="one learner rank's trained tokens/s (measure yours: bench --only real_step); "
                          "default: this project's measured 2-vCPU figure")
    simulate.add_argument("--batch-speedup", type=float, default=1.0,
                          help="an actor's batched decode over the published batch-1 tok/s (default 1: a lower bound)")
    simulate.add_argument("--link-gbps", type=float, default=10.0, help="network between Macs (10 GbE; TB5 is 80)")
    simulate.add_argument("--no-logprob-check", action="store_true",
                          help="a fleet run with security.verify_logprobs=false (trusted actors): no logprob check")
    simulate.add_argument("--check-share", type=_share, default=None,
                          help="security.check_share: older groups recomputed after an actor's probation "
                          "(default: the config's)")
    simulate.add_argument("--check-completions", type=int, default=None,
                          help="security.check_completions: of a group's completions, what such a check recomputes "
                          "(default: the config's)")
    simulate.add_argument("--on-off", action="store_true",
                          help="print steps/h with verification on and off side by side (Markdown)")
    simulate.add_argument("--group-size", type=_at_least_one, default=8)
    simulate.add_argument("--prompt-tokens", type=_at_least_one, default=150)
    simulate.add_argument("--completion-tokens", type=_at_least_one, default=384)
    simulate.add_argument("--groups-per-step", type=_at_least_one, default=16)
    simulate.add_argument("--lengths", default=None,
                          help="draw each completion's length, clipped at --completion-tokens: fixed, uniform:LOW or "
                          "lognormal:MEDIAN:SIGMA[:LOW]; prints a table with refilled decode rows and without, at the "
                          "first --ranks")
    simulate.add_argument("--padding", type=_share, default=0.0,
                          help="with --lengths: the share of the padding to a batch's longest completion the learner "
                          "pays (0: packed rows; 1: every row padded)")
    simulate.set_defaults(func=_simulate)


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Tools around a run: status, keys, doctor, build-model, bench, plot, samples."""
    status = sub.add_parser("status", help="the learner's step, version, throughput and actors")
    status.add_argument("--connect", required=True, help="learner address, e.g. tcp://192.168.1.10:5555")
    status.add_argument("--key", help="an observer's CURVE secret key (`keys add-observer NAME`): it may ask Status "
                        "and nothing else")
    status.add_argument("--learner-key", help="the learner's public key file (learner.key)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer")
    status.add_argument("--run-dir", help="also list the actors `grpo-fleet launch` stopped for good (RUN_DIR/launch.json)")
    status.set_defaults(func=_status)

    keys = sub.add_parser("keys", help="CURVE keys: who may join the fleet")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    init = keys_sub.add_parser("init", help="create the learner keypair and an empty allow-list")
    init.add_argument("dir")
    add = keys_sub.add_parser("add-actor", help="create an actor keypair and allow it")
    add.add_argument("name")
    add.add_argument("--dir", default="keys")
    rank = keys_sub.add_parser("add-rank", help="create a key for a data-parallel learner rank other than 0")
    rank.add_argument("name")
    rank.add_argument("--dir", default="keys")
    observer = keys_sub.add_parser("add-observer", help="create a key that may ask Status and nothing else")
    observer.add_argument("name")
    observer.add_argument("--dir", default="keys")
    revoke = keys_sub.add_parser("revoke", help="remove an actor or an observer from the allow-list")
    revoke.add_argument("name")
    revoke.add_argument("--dir", default="keys")
    keys.set_defaults(func=_keys)

    doctor = sub.add_parser("doctor", help="print the MLX backend, the BLAS in use and a matmul GF/s figure")
    doctor.set_defaults(func=_doctor)

    build = sub.add_parser("build-model", help="build (or find) a realshape: model in the cache and print its directory")
    build.add_argument("spec", help="e.g. realshape:qwen2.5-0.5b or 'realshape:qwen2.5-0.5b?layers=4&bits=4&seed=0'")
    build.add_argument("--cache-dir", help="model cache (default $GRPO_FLEET_MODEL_CACHE or ~/.cache/grpo-fleet/models)")
    build.set_defaults(func=_build_model)

    gguf = sub.add_parser("import-gguf", help="turn a GGUF file (llama incl. Llama 3.x, qwen2, qwen3, gemma3) into an "
                          "mlx-lm model directory")
    gguf.add_argument("file", help="a .gguf file, zoo:NAME for a model the zoo fetches (zoo:smollm2-135m-instruct, "
                      "zoo:gemma3-270m), or an app's model: ollama:NAME[:TAG], lmstudio:PUBLISHER/NAME")
    gguf.add_argument("out_dir", help="directory to write; an existing one is replaced only if import-gguf wrote it")
    gguf.add_argument("--force", action="store_true", help="replace an existing OUT_DIR that import-gguf did not write")
    gguf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="dtype of the dequantised weights (default %(default)s)")
    gguf.set_defaults(func=_import_gguf)

    bench = sub.add_parser("bench", help="benchmarks: figures next to baselines, as ratios (see bench/RESULTS.md)")
    bench.add_argument("--only", help="comma-separated subset, e.g. rollout,real_decode (names: grpo_fleet.bench.BENCHMARKS)")
    sizes = bench.add_mutually_exclusive_group()
    sizes.add_argument("--full", action="store_true",
                       help="every benchmark at full size, the long sweeps included (hours; make bench-full)")
    sizes.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    bench.add_argument("--out", default="bench/results.json", help="where to write every figure as JSON")
    bench.set_defaults(func=_bench)

    plot = sub.add_parser("plot", help="draw a run's reward, KL, tokens/s and staleness curves into one PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    plot.add_argument("--out", metavar="PNG", help="output file (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)

    samples = sub.add_parser("samples", help="print the last prompts, completions and rewards from RUN_DIR/samples.jsonl")
    samples.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding samples.jsonl")
    samples.add_argument("--last", type=_at_least_one, default=5, metavar="N", help="rows to print (default %(default)s)")
    samples.add_argument("--max-chars", type=_at_least_one, default=2000, metavar="N",
                         help="characters shown of each prompt and completion (default %(default)s)")
    samples.set_defaults(func=_samples)
    _add_simulate(sub)
    _add_export(sub)
