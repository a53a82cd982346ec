"""The `jaxpar` console script: train, launch (supervised workers), inspect, bench, report.

Recipes resolve the same way everywhere: a name in `jaxpar.train.recipes` (the checkout's
`train/recipes.py`), or `module:function` for a user's own, importable from the installed
packages or, after them, the current directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile


def _layout(name: str | None, default: str):
    from jaxpar.api import preset

    return preset(name if name is not None else default)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit 2), not usage text plus an error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"in [{low}, {high:,}]"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value:,}")
        return value

    return parse


def _finite_at_least(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value >= low and value != float("inf")):  # also false for NaN
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text}")
        return value

    return parse


def _utf8_text(text: str) -> str:
    """Text from the command line, which Python decodes with surrogateescape: refuse bytes that
    are not UTF-8 instead of failing later with an encoder's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            "not valid UTF-8 text; give the prompt in UTF-8 (e.g. iconv -t UTF-8)"
        ) from None
    return text


def _help_asked(argv: list[str] | None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return any(a in ("-h", "--help") for a in argv)


def _names() -> str:
    """Recipe and mesh preset names for --help (imports them: only when help is asked for)."""
    try:
        from jaxpar import meshes
        from jaxpar.train.recipes import RECIPES
    except ImportError as e:
        return f"recipes and mesh presets: unavailable ({e})"
    return f"recipes: {', '.join(RECIPES)}\nmesh presets: {', '.join(meshes.PRESETS)}"


def _train_epilog() -> str:
    from jaxpar.rundir.fault_kinds import TABLE

    kinds = "".join(f"  {k.usage}: {k.doc}\n" for k in TABLE)
    return (
        f"{_names()}\n"
        f"fault kinds (SPEC = KIND@STEP[:process=P][:permanent][:repeat][:seconds=X]; STEP counts "
        f"from 1; P is the process index, default 0; a spec fires once per run directory, with :repeat in every incarnation):\n"
        f"{kinds}"
        f"--set keys: SECTION.KEY (e.g. --set optim.lr=1e-3 --set model.n_layers=2); model.* are "
        f"the recipe's model config's fields; the other sections, with their defaults:\n"
        f"{_set_keys()}"
        f"Ctrl-C saves a checkpoint at the next step and prints the command that resumes; a "
        f"second Ctrl-C stops at once."
    )


def _set_keys() -> str:
    """Every --set key of the sections other than model, with its default (for --help)."""
    from jaxpar.config import TrainConfig

    out = []
    for section in dataclasses.fields(TrainConfig):
        factory = section.default_factory
        if factory is dataclasses.MISSING:
            continue
        values = ", ".join(f"{f.name}={getattr(factory(), f.name)!r}"
                           for f in dataclasses.fields(factory))  # fmt: skip
        out.append(f"  {section.name}: {values}\n")
    return "".join(out)


def add_train_arguments(
    p: argparse.ArgumentParser, argv: list[str] | None = None
) -> argparse.ArgumentParser:
    """`jaxpar train`'s options, shared with `python -m train` / `python -m jaxpar.train`."""
    from jaxpar.config import MAX_STEPS  # jax-free, as _set_keys's import

    if _help_asked(argv):
        p.epilog = _train_epilog()
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--recipe", default="gpt_tiny",
        help="name in jaxpar.train.recipes, module:function, or hf:DIR (the model of a Hugging "
        "Face checkpoint folder, random weights unless --init-from; default: gpt_tiny)",
    )  # fmt: skip
    p.add_argument(
        "--init-from", default=None, metavar="hf:DIR",
        help="start from a Hugging Face checkpoint folder's weights (its config.json must match "
        "the recipe's model; a checkpoint in the run directory wins)",
    )  # fmt: skip
    p.add_argument(
        "--mesh", default=None,
        help="preset name (jaxpar.meshes.PRESETS) or 'data=2,tensor=4' (default: the recipe's)",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=_int_at_least(1, MAX_STEPS), default=None,
        help=f"optimizer steps, 1..{MAX_STEPS:,} (default: the recipe's train.steps)",
    )  # fmt: skip
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/RECIPE-TIME)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. optim.lr=1e-3 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--fault", dest="faults", action="append", default=[], metavar="SPEC",
        help="inject a failure, e.g. kill@15 (repeatable; kinds below)",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_train)
    return p


def resolve_recipe(name: str):
    """`--recipe`: hf:DIR (a Hugging Face checkpoint folder's model, jaxpar.hf.config.recipe),
    else jaxpar.config.resolve_recipe's name or module:function."""
    if name.startswith("hf:"):
        from jaxpar.hf.config import recipe

        return recipe(name[3:])
    from jaxpar.config import resolve_recipe as by_name

    return by_name(name)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a recipe: the same run as `python -m train`, with the worker exit codes."""
    from jaxpar.api import run_worker
    from jaxpar.rundir.ownership import private_umask

    def train() -> None:
        from jaxpar import api
        from jaxpar.config import apply_overrides, validate
        from jaxpar.worker import training

        cfg = resolve_recipe(args.recipe)
        cfg = validate(apply_overrides(training.with_overrides(cfg, args.steps), args.overrides))
        keys = {o.partition("=")[0].strip() for o in args.overrides}
        cfg = training.vocab_from_data(cfg, explicit="model.vocab_size" in keys)
        mesh = args.mesh if args.mesh is not None else cfg.mesh
        summary = api.fit(cfg, mesh, args.run_dir, faults=args.faults,
                          progress=False if args.no_progress else None,
                          init_from=args.init_from)  # fmt: skip
        import jax

        if summary.get("final_loss") is not None and jax.process_index() == 0:
            print(f"run directory: {summary['run_dir']}")
            print(
                f"final loss {summary['final_loss']:.4f} after {summary['steps']} steps "
                f"in {summary['wall_s']:.1f}s"
            )

    with private_umask():  # the run directory and everything in it: this user's only
        return run_worker(train)


def cmd_inspect(args: argparse.Namespace) -> int:
    from jaxpar.worker import bootstrap

    bootstrap.configure_devices()
    from jaxpar import meshes
    from jaxpar.config import apply_overrides, validate
    from jaxpar.tools import doctor
    from jaxpar.tools.inspect import inspect, inspect_json

    target = None
    if args.target is not None:
        from jaxpar.tools import targets

        target = targets.get(args.target)  # an unknown name: one line before anything is built
    cfg = validate(apply_overrides(resolve_recipe(args.recipe), args.overrides))
    preset = _layout(args.mesh, cfg.mesh)
    for flag, what in (("json", "reports the compiled step's figures"),
                       ("doctor", "reads the compiled step's partitioning")):  # fmt: skip
        if getattr(args, flag) and args.no_audit:  # both compile the step: contradictory
            raise ValueError(f"--{flag} {what}: drop --no-audit")
    # With a target the doctor reads the report's own compilation (one compile by its compiler)
    doctor_inside = args.doctor and target is not None and not args.json and not args.no_audit
    with tempfile.TemporaryDirectory() as tmp:
        if args.json:
            print(json.dumps(inspect_json(cfg, preset, tmp, target=args.target), indent=1))
        else:
            given = doctor.inspect_command(args.recipe, args.mesh, args.overrides, args.target)
            print(inspect(cfg, preset, tmp, audit=not args.no_audit, target=args.target,
                          with_doctor=doctor_inside, command=given,
                          presets=meshes.PRESETS))  # fmt: skip
        if args.doctor and not doctor_inside:
            found = doctor.doctor(cfg, preset, tmp, target=target)
            given = doctor.inspect_command(args.recipe, args.mesh, args.overrides, args.target)
            print("\n".join(doctor.doctor_lines(found, given, cfg, meshes.PRESETS)))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from jaxpar.worker import bootstrap

    bootstrap.configure_devices()
    from jaxpar.config import apply_overrides, validate
    from jaxpar.tools.tune import tune

    cfg = validate(apply_overrides(resolve_recipe(args.recipe), args.overrides))
    axes = [a.strip() for a in args.axes.split(",") if a.strip()] if args.axes else None
    tune(cfg, args.devices, args.hardware, args.measure, args.top, args.out, axes=axes,
         target=args.target, recipe=args.recipe, overrides=args.overrides)  # fmt: skip
    return 0


def _csv(text: str | None) -> tuple[str, ...]:
    """A comma-separated option's names ("a, b" -> ("a", "b")); None or empty: ()."""
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxpar.worker import bootstrap

    # the jobs a suite starts run in sessions of their own: a SIGTERM unwinds the suite, whose
    # `finally` blocks stop them, instead of ending this process with them left running
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    bootstrap.configure_devices()
    from jaxpar.bench.harness import Bench, run_suite
    from jaxpar.config import validate
    from jaxpar.rundir.ownership import check_path

    check_path(args.out, option="--out")  # before a bench runs for minutes
    paths = _csv(args.paths)
    if args.paths is not None and args.suite != "recovery":
        raise ValueError("--paths applies to `jaxpar bench recovery` only; drop it")
    schedules = _csv(args.schedules)
    if args.schedules is not None and args.suite != "pipeline":
        raise ValueError("--schedules applies to `jaxpar bench pipeline` only; drop it")
    if schedules:
        from jaxpar.bench.pipeline import selected

        selected(schedules)  # an unknown name: one line before anything runs
    b = Bench.create(args.recipe, args.overrides, args.quick, out_dir=args.out, paths=paths,
                     schedules=schedules)  # fmt: skip
    cfg = validate(b.cfg)
    run_suite(args.suite, dataclasses.replace(b, cfg=cfg, layout=lambda t: _layout(t, cfg.mesh)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from jaxpar.rundir.ownership import check_path
    from jaxpar.rundir.runlog import skipped_lines
    from jaxpar.tools.report import write_report

    if not os.path.isdir(args.run_dir):
        raise ValueError(f"{args.run_dir} is not a directory; give a run directory")
    check_path(args.out or os.path.join(args.run_dir, "report"), option="--out")
    print(write_report(args.run_dir, args.out))
    for name, count in skipped_lines(args.run_dir).items():
        print(
            f"jaxpar report: skipped {count} line(s) of {name} that are not well-formed records "
            f"(torn, hand-edited, or a non-finite number)",
            file=sys.stderr,
        )
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from jaxpar.data.prepare import prepare

    meta = prepare(
        args.inputs, args.out, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
        tokenizer=args.tokenizer, shard_tokens=args.shard_tokens, progress=not args.no_progress,
    )  # fmt: skip
    print(
        f"{args.out}: {meta['tokens']['train']:,} train + {meta['tokens']['val']:,} val tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}) from {len(meta['sources'])} files, "
        f"{meta['input_bytes'] / 1e6:.1f} MB in {meta['seconds']:.1f}s"
    )
    if skipped := meta["skipped"]:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        print(
            f"jaxpar data prepare: not read: {', '.join(skipped[:3])}{more} (symlinks inside "
            f"folders are not followed; not regular files or not UTF-8; listed in meta.json)",
            file=sys.stderr,
        )
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from jaxpar.tools.sample import sample

    text = sample(
        args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, seed=args.seed, tokenizer=args.tokenizer,
    )  # fmt: skip
    print(text)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from jaxpar.tools.export import config_path, export, export_hf

    if args.shard_size is not None and args.format != "hf":
        raise ValueError("--shard-size applies to --format hf only; drop it")
    if args.format == "hf":
        from jaxpar.hf.save import DEFAULT_SHARD_BYTES, parse_size

        size = DEFAULT_SHARD_BYTES if args.shard_size is None else parse_size(args.shard_size)
        out = export_hf(args.run_dir, args.out, shard_bytes=size, force=args.force)
        tok = f"; tokenizer {', '.join(out['tokenizer'])}" if out["tokenizer"] else ""
        print(
            f"{args.out}: {out['parameters']:,} parameters of step {out['step']} as "
            f"{out['config']['architectures'][0]} in {len(out['files'])} safetensors file(s){tok}"
        )
        return 0
    meta = export(args.run_dir, args.out, force=args.force)
    state = f" and {len(meta['state'])} state tensors" if meta["state"] else ""
    print(
        f"{args.out}: {meta['parameters']:,} parameters{state} of step {meta['step']}; "
        f"config in {config_path(args.out)}"
    )
    return 0


def _add_model_parsers(sub) -> None:
    sam = sub.add_parser("sample", help="generate text from a run's newest checkpoint (KV cache)")
    sam.add_argument("run_dir", metavar="RUN_DIR")
    sam.add_argument("--prompt", required=True, type=_utf8_text, help="text to continue (UTF-8)")
    sam.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                     help="default: fill the context")  # fmt: skip
    sam.add_argument("--temperature", type=_finite_at_least(0.0), default=1.0,
                     help="a finite number >= 0; 0 = greedy (deterministic)")  # fmt: skip
    sam.add_argument("--top-k", type=_int_at_least(0), default=0,
                     help="sample among the k likeliest, >= 0 (0: all)")  # fmt: skip
    sam.add_argument("--seed", type=_int_at_least(0, 2**63 - 1), default=0,
                     help="random seed of the draws, >= 0 (default 0)")  # fmt: skip
    sam.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's)")
    sam.set_defaults(func=cmd_sample)
    exp = sub.add_parser("export", help="a run's model variables as safetensors + config JSON, "
                         "or as a Hugging Face checkpoint folder (--format hf)")  # fmt: skip
    exp.add_argument("run_dir", metavar="RUN_DIR")
    exp.add_argument("--out", required=True, metavar="FILE|DIR",
                     help="NAME.safetensors; with --format hf a folder")  # fmt: skip
    exp.add_argument("--format", choices=("jaxpar", "hf"), default="jaxpar",
                     help="jaxpar (default): one safetensors file of jaxpar's names; hf: a Hugging "
                     "Face folder (config.json, sharded safetensors, tokenizer) of a Llama-family "
                     "model")  # fmt: skip
    exp.add_argument("--shard-size", default=None, metavar="SIZE",
                     help="--format hf: bytes per safetensors file, e.g. 2GiB (default) or "
                     "500MB")  # fmt: skip
    exp.add_argument("--force", action="store_true",
                     help="overwrite an earlier export; export a checkpoint holding non-finite "
                     "values (refused without it)")  # fmt: skip
    exp.set_defaults(func=cmd_export)


def _add_data_parser(sub) -> None:
    data = sub.add_parser("data", help="prepare a text corpus into token shards (jaxpar docs data)")
    dsub = data.add_subparsers(dest="data_command", required=True)
    pre = dsub.add_parser(
        "prepare", help="train a byte-level BPE tokenizer and write token shards + meta.json"
    )
    pre.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="text files or folders (an INPUT that is a symlink is followed, a "
                          "symlink inside a folder is not; each file is read once)")  # fmt: skip
    pre.add_argument("--out", required=True, metavar="DIR", help="output folder (new)")
    pre.add_argument("--vocab-size", type=int, default=None,
                     help="BPE vocabulary, 257..1048576 (default 4096)")  # fmt: skip
    pre.add_argument("--val-fraction", type=float, default=0.05, help="share of bytes for val")
    pre.add_argument("--tokenizer", default=None, metavar="HF_DIR",
                     help="use a model's tokenizer as it is (a Hugging Face model folder or its "
                          "tokenizer.json), do not train one")  # fmt: skip
    pre.add_argument("--shard-tokens", type=_int_at_least(1), default=100_000_000,
                     help="tokens per shard")  # fmt: skip
    pre.add_argument("--no-progress", action="store_true", help="no progress display")
    pre.set_defaults(func=cmd_data_prepare)


def _command_run_dir(cmd: list[str]) -> str | None:
    for i, arg in enumerate(cmd):
        if arg == "--run-dir" and i + 1 < len(cmd):
            return cmd[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return None


def launch_options(args: argparse.Namespace):
    """Options for jaxpar.supervisor from `jaxpar launch`'s arguments (ValueError names the fix)."""
    import time

    from jaxpar.supervisor import Options, check_options

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    own = _command_run_dir(cmd)
    if args.run_dir and own and os.path.abspath(own) != os.path.abspath(args.run_dir):
        raise ValueError(
            f"--run-dir {args.run_dir} but the command writes to --run-dir {own}; give one of them"
        )
    run_dir = (
        args.run_dir or own or os.path.join("runs", f"launch-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    if args.nnodes > 1 and not args.coordinator:
        raise ValueError("--nnodes > 1 needs --coordinator HOST:PORT (the rank-0 agent's host)")
    opts = Options(
        command=cmd, nproc=args.nproc, run_dir=os.path.abspath(run_dir),
        devices_per_proc=args.devices_per_proc, nnodes=args.nnodes, node_rank=args.node_rank,
        coordinator=args.coordinator or "127.0.0.1:0", max_restarts=args.max_restarts,
        min_nproc=args.min_nproc, hang_timeout=args.hang_timeout,
        startup_timeout=args.startup_timeout, collective_timeout=args.collective_timeout,
        grace_s=args.grace, backoff_base_s=args.backoff, backoff_cap_s=args.backoff_cap,
        crash_loop=args.crash_loop, straggler_factor=args.straggler_factor, faults=args.faults,
        spares=not args.no_spares, bind_host=args.host, token_file=args.token_file,
        standby=args.standby, groups=args.groups,
        min_groups=args.min_groups or args.groups // 2 + 1,
    )  # fmt: skip
    check_options(opts)
    if opts.groups != 1 or opts.min_groups != 1:
        from jaxpar.supervisor.replicas import check_groups

        check_groups(opts)
    _check_fault_targets(opts.faults, opts.nproc * opts.nnodes, opts.nnodes)
    if opts.token_file:
        from jaxpar.rundir.ownership import check_secret_file

        check_secret_file(opts.token_file, "--token-file")
    return opts


def _check_fault_targets(specs: list[str], nproc: int, nnodes: int) -> None:
    """Refuse a --fault naming a process or node the job does not have: it would never fire.
    (The rest of a spec is checked by the workers, which parse it with jaxpar.worker.faults.)"""
    for spec in specs:
        for opt in spec.strip().split(":")[1:]:
            key, _, val = opt.partition("=")
            limit, what = {"process": (nproc, "process(es)"), "node": (nnodes, "node(s)")}.get(
                key, (None, "")
            )
            if limit is not None and val.isdigit() and int(val) >= limit:
                raise ValueError(
                    f"--fault {spec}: {key}={val} but the job has {limit} {what} "
                    f"(0..{limit - 1}); name one of them"
                )


def cmd_launch(args: argparse.Namespace) -> int:
    from jaxpar import supervisor
    from jaxpar.rundir.ownership import private_umask

    opts = launch_options(args)
    with private_umask():  # the run directory, its logs, what the workers write: this user's only
        return supervisor.main(opts)


def _add_launch_parser(sub) -> None:
    la = sub.add_parser(
        "launch",
        help="run COMMAND as N supervised worker processes; restart, shrink, account",
        usage="jaxpar launch --nproc N [options] -- COMMAND...",
    )
    la.add_argument("--nproc", type=_int_at_least(1), required=True,
                    help="worker processes on this host, >= 1")  # fmt: skip
    la.add_argument(
        "--devices-per-proc",
        type=int,
        default=1,
        help="devices per worker (simulated CPU devices without an accelerator)",
    )
    la.add_argument(
        "--run-dir",
        default=None,
        help="shared run directory (default: the "
        "command's --run-dir, else runs/launch-TIME); workers get JAXPAR_RUN_DIR",
    )
    la.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="failures restarted before giving up (preemptions are free)",
    )
    la.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="S",
        help="no step progress for S seconds = hang (default: max(60, 10 step times))",
    )
    la.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        metavar="S",
        help="spawn to first completed step (default: 600 s, then 3x the measured)",
    )
    la.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="S",
        help="workers' collective / coordination timeout (default: > hang timeout)",
    )
    la.add_argument(
        "--min-nproc",
        type=int,
        default=1,
        help="elastic shrink never goes below this many processes (all hosts)",
    )
    la.add_argument(
        "--grace",
        type=float,
        default=1.0,
        metavar="S",
        help="SIGTERM -> SIGKILL grace when stopping survivors",
    )
    la.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        metavar="S",
        help="first backoff of repeated failures (doubles, capped)",
    )
    la.add_argument("--backoff-cap", type=float, default=30.0, metavar="S")
    la.add_argument(
        "--crash-loop",
        type=int,
        default=3,
        metavar="K",
        help="give up after the same failure at the same step K times (NaN: 2)",
    )
    la.add_argument(
        "--straggler-factor",
        type=float,
        default=2.0,
        help="report a process whose step work is this many times the others'",
    )
    la.add_argument(
        "--fault",
        dest="faults",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault spec passed to the workers in JAXPAR_FAULTS (repeatable)",
    )
    la.add_argument(
        "--no-spares",
        action="store_true",
        help="do not pre-start the next group's workers while a group trains (restarts then "
        "pay Python and jax start-up again)",
    )
    la.add_argument(
        "--standby",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="while a group trains, build the next incarnation's group up to its first step "
        "(jax.distributed, mesh, compiled step) and switch to it on a failure; one host (with "
        "--groups: every host, for its own groups; give it to every agent), devices that can be "
        "shared (CPU); default off: it holds a second set of devices and memory while "
        "the job trains (jaxpar docs cluster)",
    )
    la.add_argument(
        "--groups",
        type=_int_at_least(1),
        default=1,
        metavar="R",
        help="run the processes as R replica groups, each its own jax.distributed world and "
        "mesh, data parallel across groups; a failed group restarts alone while the others keep "
        "training; with --nnodes N, R is a multiple of N and each host runs R/N whole groups "
        "(jaxpar docs cluster)",
    )
    la.add_argument(
        "--min-groups",
        type=_int_at_least(1),
        default=None,
        metavar="M",
        help="the smallest quorum of groups that trains a step (default: more than half)",
    )
    la.add_argument("--nnodes", type=_int_at_least(1), default=1,
                    help="hosts, one agent each, >= 1")  # fmt: skip
    la.add_argument("--node-rank", type=int, default=0, help="this agent's host index")
    la.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="rank-0 agent's address (control channel; HOST also serves jax); IPv6 as [ADDR]:PORT; "
        "a wildcard such as 0 or 0.0.0.0 is refused (to listen on every interface, give the "
        "host's address here and --host 0.0.0.0, which says so on the console)",
    )
    la.add_argument(
        "--host",
        default=None,
        metavar="ADDR",
        help="address the rank-0 agent's control channel and jax's coordinator bind to "
        "(default: 127.0.0.1 on one node, else exactly the --coordinator host; 0.0.0.0 or :: "
        "for every interface)",
    )
    la.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="the agents' shared secret, a file only you can read (default: $JAXPAR_LAUNCH_TOKEN, "
        "else RUN_DIR/launch-token, created 0600 by the first agent); every agent must use the "
        "same",
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND...")
    la.set_defaults(func=cmd_launch)


def _docs_dir() -> str | None:
    """The user guides: jaxpar/docs/ in an installed package, docs/ beside jaxpar/ in a checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (os.path.join(here, "docs"), os.path.join(os.path.dirname(here), "docs")):
        if os.path.isfile(os.path.join(folder, "design.md")):
            return folder
    return None


EXAMPLES = "examples"  # the example scripts the guides use: docs/examples/*.py


def docs_topics() -> dict[str, str]:
    """Topic -> the page's path (the guides' file names without .md)."""
    folder = _docs_dir()
    names = sorted(os.listdir(folder)) if folder else []
    return {n[: -len(".md")]: os.path.join(folder, n) for n in names if n.endswith(".md")}


def docs_examples() -> dict[str, str]:
    """Example script -> its path (`examples/NAME.py`), shipped beside the guides."""
    folder = _docs_dir()
    where = os.path.join(folder, EXAMPLES) if folder else ""
    names = sorted(os.listdir(where)) if where and os.path.isdir(where) else []
    return {f"{EXAMPLES}/{n}": os.path.join(where, n) for n in names if n.endswith(".py")}


def _first_line(path: str) -> str:
    """A page's title, or a script's first docstring line."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = line.strip().lstrip("#").strip().strip('"').strip()
            if text:
                return text
    return ""


def cmd_docs(args: argparse.Namespace) -> int:
    topics, examples = docs_topics(), docs_examples()
    if not topics:
        raise ValueError("this installation has no documentation pages (jaxpar/docs/ is missing)")
    if args.topic is None:
        for topic, path in topics.items():
            print(f"{topic:<16} {_first_line(path)}")
        if examples:
            print(f"{EXAMPLES:<16} the example scripts the guides use (jaxpar docs {EXAMPLES})")
        return 0
    if args.topic == EXAMPLES:
        for name, path in examples.items():
            print(f"{name:<28} {_first_line(path)}")
        print(f"\nprint one: jaxpar docs {EXAMPLES}/NAME.py (> NAME.py to run it from a folder of "
              f"your own)")  # fmt: skip
        return 0
    name = args.topic if args.topic in examples else f"{EXAMPLES}/{args.topic}"
    path = topics.get(args.topic) or examples.get(name)
    if path is None:
        raise ValueError(f"no page {args.topic!r}; topics: {', '.join([*topics, EXAMPLES])} "
                         f"(jaxpar docs)")  # fmt: skip
    with open(path, encoding="utf-8") as f:
        sys.stdout.write(f.read())
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    argv = sys.argv[1:] if argv is None else argv
    # only `train`, `inspect` and `bench --help` list recipes and presets (they import jax)
    names = _names() if argv[:1] in (["inspect"], ["bench"]) and _help_asked(argv) else None
    raw = argparse.RawDescriptionHelpFormatter
    p = Parser(prog="jaxpar", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"jaxpar {_version()}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    train_argv = argv if argv[:1] == ["train"] else []
    add_train_arguments(
        sub.add_parser("train", help="train a recipe (same as python -m train)"), train_argv
    )
    ins = sub.add_parser(
        "inspect", help="parameter shardings and the compiled step's collectives",
        epilog=names, formatter_class=raw,
    )  # fmt: skip
    ins.add_argument("--recipe", default="gpt_tiny", help="recipe name or module:function "
                     "(default: gpt_tiny)")  # fmt: skip
    ins.add_argument("--mesh", default=None, help="preset name or mesh spec (default: the "
                     "recipe's; all devices on data)")  # fmt: skip
    ins.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value (repeatable)")  # fmt: skip
    ins.add_argument("--no-audit", action="store_true", help="skip compiling the step")
    ins.add_argument("--json", action="store_true", help="print the mesh, the compiled step's "
                     "per-device memory (arguments, outputs, temps, peak bytes) and collectives "
                     "as JSON")  # fmt: skip
    ins.add_argument("--doctor", action="store_true", help="map the partitioner's involuntary "
                     "rematerializations to source lines and rules, propose a verified rule "
                     "change; the largest collectives with their source lines")  # fmt: skip
    ins.add_argument("--target", default=None, metavar="NAME",
                     help="compile the step with that accelerator's own XLA compiler, here, for "
                     "its devices: h100x8, h100x16, h200x8, a100x8 (jaxpar[cuda-aot]), v5e-8, "
                     "v5e-256, v5p-32, v5p-128, v6e-8 (jaxpar[tpu-aot]); per-device memory and "
                     "whether it fits, FLOPs, collectives (jaxpar docs targets)")  # fmt: skip
    ins.set_defaults(func=cmd_inspect)
    tun = sub.add_parser("tune", help="rank the layouts of N devices by predicted step time "
                         "(compiled programs on a hardware profile)")  # fmt: skip
    tun.add_argument("--recipe", default="gpt_tiny", help="recipe name or module:function")
    tun.add_argument("--devices", type=_int_at_least(1), default=None,
                     help="devices to lay out (required unless --target gives them)")  # fmt: skip
    tun.add_argument("--hardware", default=None, help="profile: h100x8, h100x16, h200x8, a100x8, "
                     "v5e-8, v5e-256, v5p-32, v5p-128, v6e-8, or cpu (measured on this machine; "
                     "default)")  # fmt: skip
    tun.add_argument("--target", default=None, metavar="NAME",
                     help="compile every layout with that accelerator's own XLA compiler (its "
                     "devices, its memory decides what fits) and predict on its profile; names "
                     "as --hardware but cpu (jaxpar docs targets)")  # fmt: skip
    tun.add_argument("--measure", type=_int_at_least(0), default=0, metavar="K",
                     help="run K layouts (the top and a spread) here and compare")  # fmt: skip
    tun.add_argument("--top", type=_int_at_least(1), default=10, help="rows printed (default 10)")
    tun.add_argument("--out", default=None, help="write the result as JSON to this file")
    tun.add_argument("--axes", default=None, metavar="A,B", help="only these mesh axes (default: "
                     "every axis the model supports)")  # fmt: skip
    tun.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value (repeatable)")  # fmt: skip
    tun.set_defaults(func=cmd_tune)
    from jaxpar.bench import harness

    suites = "suites (rough time on a 2-core CPU host, full and --quick):\n" + harness.describe()
    ben = sub.add_parser(
        "bench", help="benchmarks measured side by side (medians, ratios)",
        epilog=suites + (f"\n\n{names}" if names else ""), formatter_class=raw,
    )  # fmt: skip
    ben.add_argument("suite", choices=sorted(harness.SUITES), metavar="SUITE",
                     help="one of: " + ", ".join(sorted(harness.SUITES)))  # fmt: skip
    ben.add_argument("--recipe", default=harness.DEFAULT_RECIPE,
                     help=f"the recipe measured (default: {harness.DEFAULT_RECIPE})")  # fmt: skip
    ben.add_argument("--out", default="bench-results", help="directory for SUITE.json "
                     "(default: bench-results)")  # fmt: skip
    ben.add_argument("--quick", action="store_true", help="a small, fast version")
    ben.add_argument("--paths", default=None, metavar="P,P",
                     help="recovery only: the restart paths measured, comma-separated, of cold, "
                     "persistent, local, standby, standby-hang (default: all)")  # fmt: skip
    ben.add_argument("--schedules", default=None, metavar="S,S",
                     help="pipeline only: the schedules measured, comma-separated, of gpipe, "
                     "circular, 1f1b, interleaved_1f1b, zero_bubble (default: all)")  # fmt: skip
    ben.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value (repeatable)")  # fmt: skip
    ben.set_defaults(func=cmd_bench)
    rep = sub.add_parser("report", help="RUN_DIR/report/report.md: loss, step time, goodput plots")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    rep.set_defaults(func=cmd_report)
    doc = sub.add_parser(
        "docs", help="print a guide (design, data, cluster, api, ...) or an example script the "
        "guides use; no TOPIC: list them"
    )  # fmt: skip
    doc.add_argument("topic", nargs="?", metavar="TOPIC", help="a page's name, e.g. cluster; "
                     "`examples` lists the example scripts, `examples/NAME.py` prints one")  # fmt: skip
    doc.set_defaults(func=cmd_docs)
    _add_launch_parser(sub)
    _add_data_parser(sub)
    _add_model_parsers(sub)
    return p


def _version() -> str:
    from jaxpar import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    from jaxpar.usercode import search_current_directory

    # `python -c`/`python -m jaxpar.cli` put the current directory first on sys.path: a folder
    # there named like an installed package (matplotlib/) must never shadow it.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)
    search_current_directory()  # a user's recipe module, after the installed packages
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
