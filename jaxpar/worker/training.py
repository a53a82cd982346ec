"""The training loop: config -> mesh -> sharded state -> steps -> run directory.

    recipe -> TrainConfig -> Preset (mesh + rules) -> Program (step.py) -> init or restore ->
    loop { batch(step) -> train step -> metrics -> maybe save -> fault/preemption checks }

Used by `python -m train` and by tests that build a config in Python and call `run(config)`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar import contract
from jaxpar.config import TrainConfig, config_hash, to_dict, validate, warnings_for
from jaxpar.data import sources as data_lib
from jaxpar.engine.losses import VECTOR_METRICS
from jaxpar.engine.mesh import MeshSpec, make_mesh
from jaxpar.engine.rules import Preset, validate_rules
from jaxpar.parallel.program import Program, build_program, code_digest, decay_horizon
from jaxpar.recovery import compile_cache
from jaxpar.recovery.checkpoint import (
    Checkpointer,
    Preempted,
    say,
    warm_replica_check,
)
from jaxpar.recovery.checkpoint import preflight as checkpoint_preflight
from jaxpar.recovery.local_tier_store import exchange
from jaxpar.recovery.tiers import (
    PersistentTier,
    Tier,
    TierSetup,
    build_tiers,
    config_meta,
    restore_newest,
)
from jaxpar.rundir import ownership, runlog
from jaxpar.rundir.runlog import WorkerEvent, write_json
from jaxpar.rundir.writer import Progress, RunDir, TensorBoardWriter, mfu, peak_flops, summarize
from jaxpar.worker import bootstrap, groups, standby
from jaxpar.worker.faults import Faults, NonFiniteLoss
from jaxpar.worker.faults import check_processes as check_fault_processes
from jaxpar.worker.faults import parse_all as parse_faults
from jaxpar.worker.hooks import AFTER, BEFORE, Hooks, StepContext


@dataclass
class Session:
    """What one incarnation of a run has built: layout, data source, compiled program, writers."""

    cfg: TrainConfig
    preset: Preset
    mesh: jax.sharding.Mesh
    source: data_lib.Source
    program: Program
    run: RunDir
    flops_per_step: float | None
    peak: float | None
    tb: TensorBoardWriter | None = None  # log.tensorboard, process 0
    link: groups.GroupLink | None = None  # a replica group's link to the group hub (--groups)
    eval_compiled: Any = None  # the compiled eval step, once loaded (eval_program)
    lr_path: tuple | None = None  # where the recipe's own optimizer keeps its learning rate
    # --init-from: opens the checked checkpoint folder (jaxpar.hf.load.Folder) the first state's
    # parameters come from when no restore tier holds a state; its text for the console
    init_from: Any = None
    init_text: str = ""


def injected_lr_path(program: Program) -> tuple | None:
    """Where the learning rate of a recipe's own optimizer is, for the metrics line: the key
    path of the first `hyperparams["learning_rate"]` in the optimizer state (an optax
    `inject_hyperparams` transformation keeps there the value its schedule gave the step just
    taken). None when jaxpar's own schedule gives `lr`, or the optimizer keeps none."""
    if program.schedule is not None:
        return None
    opt = program.abstract_state.get("opt", {})
    for path, _ in jax.tree_util.tree_flatten_with_path(opt)[0]:
        if (
            len(path) >= 2
            and getattr(path[-2], "name", None) == "hyperparams"
            and getattr(path[-1], "key", None) == "learning_rate"
        ):
            return ("opt", *path)
    return None


def injected_lr(state: dict, path: tuple) -> float | None:
    """The value at `path` (injected_lr_path) of a training state, on the host."""
    x: Any = state
    for key in path:
        if isinstance(key, str):
            x = x[key]
        elif isinstance(key, jax.tree_util.GetAttrKey):
            x = getattr(x, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            x = x[key.key]
        elif isinstance(key, jax.tree_util.SequenceKey):
            x = x[key.idx]
        else:
            return None
    if isinstance(x, jax.Array):  # replicated: this process's copy (it may not hold them all)
        x = x.addressable_data(0)
    return float(np.mean(np.asarray(x)))


def make_source(cfg: TrainConfig) -> data_lib.Source:
    """The run's data source (`data.source`: a name, MODULE:CALLABLE, or an object)."""
    vocab = getattr(cfg.model, "vocab_size", 256)
    seq = getattr(cfg.model, "seq_len", cfg.data.seq_len)
    return data_lib.make_source(
        cfg.data.source, seq_len=seq, vocab_size=vocab, seed=cfg.data.seed, path=cfg.data.path,
        dtype=cfg.data.dtype,
    )  # fmt: skip


def check_vocab(cfg: TrainConfig, source: data_lib.Source) -> None:
    """A source that fixes its vocabulary (a trained tokenizer) needs a model whose table holds
    every id: a vocabulary at least as large (a larger one is a padded table, as Hugging Face
    checkpoints have: Qwen3's 151,936 entries for its tokenizer's 151,669)."""
    want, have = getattr(source, "vocab_size", None), getattr(cfg.model, "vocab_size", None)
    if getattr(source, "vocab_fixed", False) and have is not None and want > have:
        raise ValueError(
            f"model.vocab_size={have} but the data ({data_lib.describe(source)}) has a vocabulary "
            f"of {want}; set --set model.vocab_size={want} (python -m train takes it from the data "
            "unless model.vocab_size is set)"
        )


def vocab_from_data(cfg: TrainConfig, explicit: bool = False) -> TrainConfig:
    """`cfg` with the model's vocab_size taken from a source that fixes it (tokens' meta.json).

    explicit: model.vocab_size was given by the user; a smaller one is then an error. A model
    vocabulary larger than the data's is kept (a padded table, e.g. a checkpoint's)."""
    if not hasattr(cfg.model, "vocab_size"):
        return cfg
    source = make_source(cfg)
    want = getattr(source, "vocab_size", None)
    if explicit or not getattr(source, "vocab_fixed", False) or want <= cfg.model.vocab_size:
        check_vocab(cfg, source)
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=want))


def flops_per_step(cfg: TrainConfig, source: data_lib.Source) -> float | None:
    """Model FLOPs of one optimizer step by the 6*N*T formula (plus attention), where known."""
    seq = source.seq_len if source.kind == "lm" else 1
    return contract.flops_per_step(cfg.model, source.kind, cfg.data.global_batch, seq)


def setup(
    cfg: TrainConfig,
    preset: Preset,
    run_dir: str,
    incarnation: int | None = None,
    devices: list | None = None,
    create: bool = True,
) -> Session:
    """Build the mesh (over `devices`, default all), data source and program; write config.json
    (create=False: write nothing yet, see `open_run_dir`)."""
    contract.check_model_config(cfg.model)
    validate_rules(preset.params)
    validate_rules(preset.acts)
    mesh = make_mesh(preset.mesh, devices)
    source = make_source(cfg)
    check_vocab(cfg, source)
    gcfg = groups.group_cfg(cfg, mesh)  # a replica group's share of the batch (else cfg itself)
    spec = data_lib.batch_spec(source, gcfg.data.global_batch)
    program = build_program(gcfg, mesh, preset.params, preset.acts, spec, source.kind)
    run = RunDir(run_dir, groups.run_process_index(), incarnation, create=False)
    kind = jax.devices()[0].device_kind
    s = Session(
        cfg, preset, mesh, source, program, run, flops_per_step(gcfg, source), peak_flops(kind),
        lr_path=injected_lr_path(program),
    )  # fmt: skip
    if create:
        open_run_dir(s)
    return s


def open_run_dir(s: Session) -> None:
    """Create the run directory and write config.json (after every check has passed)."""
    standby.wait_for_go()  # a standby writes nothing to the run directory before "go"
    s.run.create()
    if s.run.is_writer:
        resolved = to_dict(s.cfg)
        resolved["mesh_resolved"] = str(MeshSpec(**dict(s.mesh.shape)))
        resolved["config_hash"] = config_hash(s.cfg)
        write_json(s.run.file(runlog.CONFIG), resolved)


def device_batch(s: Session, step: int, split: str = "train") -> dict:
    index, count = groups.batch_rows()  # a replica group's rows are its share of the batch
    local = data_lib.host_batch(
        s.source, step=step, global_batch=s.cfg.data.global_batch, seed=s.cfg.data.seed,
        process_index=index, process_count=count, split=split,
    )  # fmt: skip
    return data_lib.to_device(local, s.program.batch_shardings, _batch_size(s))


def _batch_size(s: Session) -> int:
    """Rows of one step's batch on this mesh (a replica group's share of the global batch)."""
    return s.cfg.data.global_batch // groups.group_count()


def _abstract_batch(s: Session) -> dict:
    spec = data_lib.batch_spec(s.source, _batch_size(s))
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.program.batch_shardings[k])
        for k, v in spec.items()
    }


def compile_step(s: Session):
    """AOT-compile the train step for the abstract state and batch; returns (compiled, seconds).
    A replica group's step is its two halves (groups.compile_halves)."""
    if groups.active():
        return groups.compile_halves(s.program, _abstract_batch(s))
    t0 = time.time()
    batch = _abstract_batch(s)

    def lower() -> jax.stages.Lowered:
        return s.program.train_step.lower(s.program.abstract_state, batch)

    parts = step_parts(s, batch)
    if parts is None:  # code of the user's own in the step: keyed by the lowered program
        compiled, _ = compile_cache.compile(lower(), "train_step")
    else:  # all jaxpar's own: a cached step loads without tracing and lowering it again
        compiled, _ = compile_cache.compile_by_key("train_step", parts, lower)
    return compiled, time.time() - t0


def step_parts(s: Session, batch: dict) -> tuple | None:
    """What fixes the train step's program when all of it is jaxpar's own code (a built-in
    model, loss and optimizer): the whole config, the layout, the abstract state and batch with
    their shardings, jaxpar's sources and the versions and flags of the libraries that trace
    it. None when a recipe brings code of its own (a loss, an optimizer, a model class): its
    program is then keyed by its lowered text (compile_cache.compile)."""
    cfg = s.cfg
    if cfg.loss is not None or cfg.optimizer is not None:
        return None
    if not type(cfg.model).__module__.startswith("jaxpar."):
        return None
    import flax
    import optax

    leaves = [(a.shape, str(a.dtype), repr(a.sharding)) for a in
              jax.tree.leaves((s.program.abstract_state, batch))]  # fmt: skip
    return (
        "train_step", json.dumps(program_config(cfg), sort_keys=True, default=repr), repr(s.preset),
        str(s.source.kind), repr(jax.tree.structure((s.program.abstract_state, batch))),
        repr(leaves), repr([d.id for d in s.mesh.devices.flat]), code_digest(),
        flax.__version__, optax.__version__, np.__version__,
        repr(sorted(jax.config.values.items())),
    )  # fmt: skip


# Config sections and loop fields that never reach the train step's program: a run extended with
# --steps, or rerun with other checkpoint, log or evaluation settings, loads its compiled step.
_NOT_IN_STEP = ("name", "log", "ckpt", "run")
_LOOP_NOT_IN_STEP = ("steps", "eval_every", "eval_batches")


def program_config(cfg: TrainConfig) -> dict:
    """The part of `cfg` that fixes a built-in train step (step_parts' key): the config without
    the sections and loop fields that never reach it, and with `train.steps` replaced by what
    it does reach, the learning-rate schedule's decay horizon (make_optimizer's)."""
    d = {k: v for k, v in to_dict(cfg).items() if k not in _NOT_IN_STEP}
    d["train"] = {k: v for k, v in d["train"].items() if k not in _LOOP_NOT_IN_STEP}
    d["train"]["decay_horizon"] = decay_horizon(cfg.optim, cfg.train.steps)
    return d


def eval_program(s: Session):
    """The eval step, AOT-compiled once per incarnation through the compiled-program cache (a
    restarted group loads it instead of compiling it again at its first evaluation)."""
    if s.eval_compiled is None:
        lowered = s.program.eval_step.lower(s.program.abstract_state, _abstract_batch(s))
        s.eval_compiled = compile_cache.compile(lowered, "eval_step")[0]
    return s.eval_compiled


def evaluate(s: Session, state: dict, step: int) -> dict:
    """Loss and every metric of the loss, averaged over train.eval_batches batches of the eval
    split; written as eval_loss, eval_NAME. Returns the metrics line."""
    values: dict[str, list[float]] = {}
    program = eval_program(s)
    for i in range(s.cfg.train.eval_batches):
        batch = device_batch(s, i, split="eval")
        for k, v in jax.device_get(program(state, batch)).items():
            if k not in VECTOR_METRICS:  # per-expert loads are reported by training steps
                values.setdefault(k, []).append(float(np.mean(v)))
    order = sorted(values, key=lambda k: k != "loss")  # eval_loss first
    line = {"step": step, **{f"eval_{k}": float(np.mean(values[k])) for k in order}}
    line["time"] = time.time()
    s.run.metrics(line)
    if s.tb:
        s.tb.write(line)
    return line


ENGINE_METRICS = ("loss", "lr", "grad_norm")  # the step's own; the rest come from the loss


def loss_metrics(line: dict, prefix: str = "") -> dict:
    """The loss function's own metrics (e.g. accuracy) of a metrics line, for display."""
    skip = {f"{prefix}{k}" for k in ENGINE_METRICS}
    return {k: v for k, v in line.items() if k.startswith(prefix) and k not in skip
            and k not in METRICS_LINE_KEYS and not isinstance(v, list)}  # fmt: skip


def metrics_line(s: Session, step: int, m: dict, dt: float, state: dict | None = None) -> dict:
    """The metrics line of a step: `m` (the step's metrics), its time `dt`, throughput, MFU,
    memory; `lr` from `state` when the step does not return it (a recipe's own optimizer)."""
    # per-replica values (DiLoCo) are averaged on the host, adding no collective
    line = {"step": step, "loss": float(np.mean(m["loss"])), "step_time_s": dt}
    b = s.cfg.data.global_batch
    if s.source.kind == "lm":
        line["tokens_per_s"] = b * s.source.seq_len / dt
    else:
        line["samples_per_s"] = b / dt
    line["mfu"] = mfu(s.flops_per_step, dt, jax.device_count(), s.peak)
    stats = jax.local_devices()[0].memory_stats()  # None on CPU
    line["mem_gb"] = stats["bytes_in_use"] / 1e9 if stats and "bytes_in_use" in stats else None
    for k, v in m.items():  # lr, grad_norm and every metric the loss returns (e.g. accuracy)
        if k != "loss":
            line[k] = metric_value(k, v)
    if "lr" not in line and state is not None and s.lr_path is not None:
        line["lr"] = injected_lr(state, s.lr_path)
    if s.link is not None:  # replica groups: which took part, and the rows they trained
        line["quorum"] = list(s.link.quorum)
        rows = b * len(s.link.quorum) / s.link.groups
        key = "tokens_per_s" if s.source.kind == "lm" else "samples_per_s"
        line[key] = line[key] * rows / b
    line["time"] = time.time()
    return line


def metric_value(key: str, v) -> float | list[float]:
    """A metric for the metrics line: a float (the mean over any per-replica dimension), or for
    a vector metric (losses.VECTOR_METRICS, e.g. moe_expert_load) a list over its last axis."""
    if key in VECTOR_METRICS and np.ndim(v) >= 1:
        a = np.asarray(v, dtype=np.float64)
        return [float(x) for x in a.reshape(-1, a.shape[-1]).mean(0)]
    return float(np.mean(v))


# keys of a metrics line that are not metrics of the model
METRICS_LINE_KEYS = frozenset(
    ("step", "step_time_s", "tokens_per_s", "samples_per_s", "mfu", "mem_gb", "time", "quorum")
)


def _stop_requested(s: Session, ckpt: Checkpointer, step: int, t_start: float) -> str | None:
    ckpt.check()  # a background save that failed (a full disk) stops the run now
    if ckpt.reached_preemption(step):
        return "preempted"
    limit = s.cfg.run.max_wall_s
    if limit > 0:
        over = np.int32(time.time() - t_start > limit)
        if jax.process_count() > 1:  # every process must stop at the same step
            over = multihost_utils.broadcast_one_to_all(over)
        if over:
            return "wall_time"
    return None


class NothingToDo(Exception):
    """The run directory's checkpoint is already at or past the requested steps."""


def preflight(cfg: TrainConfig, run_dir: str, faults: list[str]) -> list:
    """Every check that can refuse a run, before it writes anything to `run_dir`: config ranges,
    fault specs, the path, the newest checkpoint's config. Returns the parsed fault specs.

    Raises ValueError (CheckpointMismatch) naming the fix, or NothingToDo."""
    validate(cfg)
    specs = parse_faults(list(faults))
    if not os.environ.get(bootstrap.ENV_SUPERVISED):  # a launched job may have shrunk since
        check_fault_processes([s for s in specs if s.text in faults], jax.process_count())
    ownership.check_path(run_dir)
    ownership.check_owner(run_dir)
    ckpt_dir = os.path.join(run_dir, runlog.CHECKPOINTS)
    meta = config_meta(cfg)
    step = checkpoint_preflight(ckpt_dir, meta, which=cfg.ckpt.restore, force=cfg.ckpt.force)
    if (
        step is not None
        and step >= cfg.train.steps
        and not os.environ.get(bootstrap.ENV_SUPERVISED)
    ):
        raise NothingToDo(f"checkpoint at step {step} ≥ --steps {cfg.train.steps}; nothing to do")
    return specs


def init_source(cfg: TrainConfig, run_dir: str, init_from: str | None) -> Any:
    """`--init-from hf:DIR`, checked before anything is written: a function opening the folder
    (every file and tensor already checked against the recipe's model), or None when it is not
    given or when the run directory's newest checkpoint will be restored instead (resumption:
    the checkpoint wins, said in one line; the folder is not read)."""
    if not init_from:
        return None
    from jaxpar.hf import load as hf_load

    path = hf_load.source_folder(init_from)
    ckpt_dir = os.path.join(run_dir, runlog.CHECKPOINTS)
    step = checkpoint_preflight(
        ckpt_dir, config_meta(cfg), which=cfg.ckpt.restore, force=cfg.ckpt.force
    )
    if step is not None:
        if jax.process_index() == 0:
            say(f"--init-from {init_from} not read: resuming from the checkpoint at step {step} "
                f"in {ckpt_dir} (a run directory's checkpoint wins)")  # fmt: skip
        return None
    folder = hf_load.open_folder(path, expect=cfg.model)
    return lambda: folder


def _first_state(s: Session):
    """The function giving the first state when no restore tier holds one: the program's
    init (`fresh_state`), or the --init-from folder's parameters around a fresh optimizer
    state."""
    if s.init_from is None:
        return lambda: fresh_state(s)

    def init() -> dict:
        from jaxpar.hf import load as hf_load

        with s.init_from() as folder:
            return hf_load.initial_state(s.program, folder)

    return init


def fresh_state(s: Session) -> dict:
    """The program's initial state, its init program through the compiled-program cache: keyed
    like the train step where all of it is jaxpar's own (`step_parts`), so a fresh run of a
    layout and config the cache has seen neither traces, lowers nor compiles it; else keyed by
    its lowered text."""
    parts = step_parts(s, _abstract_batch(s))
    if parts is None:
        compiled, _ = compile_cache.compile(s.program.init.lower(), "init")
    else:
        key = ("init", *parts[1:])  # the train step's parts, another program
        compiled, _ = compile_cache.compile_by_key("init", key, s.program.init.lower)
    return compiled()


_STARTS = itertools.count()  # names of the start's exchanges, unique within a process


def take_lock(s: Session) -> ownership.RunDirLock | None:
    """The run directory's lock: process 0 takes it (or runs under its supervisor's) for every
    process; RunDirLocked on all processes when another run holds it."""
    lock, error = None, ""
    if jax.process_index() == 0:
        try:
            lock = ownership.acquire_or_inherit(s.run.path, "python -m train")
        except ownership.RunDirLocked as e:
            error = str(e)
    # through the coordination service: a collective here compiled a program at every start
    tag = f"lock/{next(_STARTS)}"  # every process takes it in the same order
    ok = not exchange(tag, error)[0] if jax.process_count() > 1 else not error
    if not ok:
        raise ownership.RunDirLocked(error or ownership.locked_message(s.run.path))
    if lock is not None and lock.took_over and lock.took_over.get("pid"):
        say(
            f"took over the lock of {ownership.describe(lock.took_over)}, which is no longer running"
        )
    return lock


def run(
    cfg: TrainConfig,
    preset: Preset,
    run_dir: str,
    *,
    faults: list[str] = (),
    progress: bool | None = None,
    init_from: str | None = None,
) -> dict:
    """Train `cfg` on `preset`'s mesh, writing `run_dir`; returns the summary dict.

    Nothing is written to `run_dir` until every check has passed (`preflight`, the mesh and
    program) and the run directory's lock is held. Raises Preempted (after a coordinated save),
    NonFiniteLoss, NonFiniteState (a state of NaNs that was to be saved), ReplicaMismatch,
    NothingToDo, or ValueError for a refused run.
    `init_from` (`hf:DIR`): the first state's parameters come from a Hugging Face checkpoint
    folder, unless the run directory holds a state to resume (init_source).
    """
    t_start = time.time()
    cfg, preset = supervised_layout(cfg, preset)
    env_inc = os.environ.get("JAXPAR_INCARNATION")
    specs = preflight(cfg, run_dir, list(faults))
    opener = init_source(cfg, run_dir, init_from)
    s = setup(cfg, preset, run_dir, int(env_inc) if env_inc else None, create=False)
    s.init_from, s.init_text = opener, init_from or ""
    early = None
    if standby.pending():  # the next incarnation, built ahead: wait for the failure here
        early = prepare_standby(s)
        t_start = time.time()
    lock = take_lock(s)
    try:
        return _run_locked(s, specs, t_start, progress, early)
    finally:
        if lock is not None:
            lock.release()


def _shared_cache(cfg: TrainConfig) -> str | None:
    return compile_cache.shared_directory(cfg.run.compile_cache_dir)


def prepare_standby(s: Session) -> tuple:
    """A standby worker (jaxpar/worker/standby.py): load or compile the train step without writing the
    run directory, report ready and wait for "go". Returns (compiled, seconds)."""
    directory = s.run.file(runlog.COMPILED) if s.cfg.run.compile_cache else None
    compile_cache.configure(directory, readonly=True, shared=_shared_cache(s.cfg))
    early = compile_step(s)
    if 0 < s.cfg.train.eval_every <= s.cfg.train.steps:
        eval_program(s)  # loaded now, not at the new group's first evaluation
    warm_step(s, early[0])
    standby.wait_for_go()  # returns on "go"; a released standby exits here
    return early


def warm_step(s: Session, compiled) -> None:
    """Run the restore's replica check and the compiled step once on a throwaway state of zeros
    and batch 0, and drop the results: their collectives connect (gloo on CPU connects at a
    program's first collective) and their first-run set-up happens now, not in the restore and
    the first step after a failure. Nothing is written; the extra state lives only while it
    runs. A failure costs only the warm-up."""

    def zeros(a):
        return jax.make_array_from_callback(
            a.shape, a.sharding, lambda idx: np.zeros(_shard_shape(a.shape, idx), a.dtype)
        )

    try:
        state = jax.tree.map(zeros, s.program.abstract_state)
        t0 = time.time()
        warm_replica_check(state, s.mesh)  # what a restore runs on the state it read
        step = compiled[0] if groups.active() else compiled  # a group's gradients half
        jax.block_until_ready(step(state, device_batch(s, 0)))
        print(f"jaxpar: standby warm-up step ran ({time.time() - t0:.2f}s)", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the standby still goes, its first step is colder
        print(f"jaxpar: standby warm-up step skipped ({type(e).__name__}: {e})", file=sys.stderr)


def _shard_shape(shape: tuple, index: tuple) -> tuple:
    """The shape of `index` (a tuple of slices, as make_array_from_callback passes) into `shape`."""
    return tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape, strict=False))


def begin_incarnation(s: Session) -> None:
    """What a process does first once it holds the run directory (the lock): config.json, the
    compiled-program cache, warnings, the incarnation number and the `start` event that begins
    the incarnation (the loop here, and a loop of one's own through jaxpar.CheckpointManager)."""
    cfg = s.cfg
    open_run_dir(s)
    compile_cache.configure(
        s.run.file(runlog.COMPILED) if cfg.run.compile_cache else None, shared=_shared_cache(cfg)
    )
    if s.run.is_writer:
        for name, bad in s.run.unreadable_lines().items():
            say(f"{s.run.file(name)}: skipped {bad} unreadable line(s) (torn or not JSON)")
        for text in warnings_for(cfg):
            say(f"warning: {text}")
    # all processes counted earlier starts before this one is logged (the coordination
    # service's barrier: a collective compiled a program at every start)
    bootstrap.barrier(f"jaxpar_start_{next(_STARTS)}")
    s.run.write_incarnation()
    mesh_text = str(MeshSpec(**dict(s.mesh.shape)))
    warning = contract.unsharded_warning(s.program.param_logical)
    if warning and s.run.is_writer:
        print(f"jaxpar: {warning}", file=sys.stderr)
    s.run.event(
        WorkerEvent.START, nproc=jax.process_count(), mesh=mesh_text,
        warm=standby.start_path() != "cold",  # a pre-started spare or standby worker
        path=standby.start_path(),
    )  # fmt: skip
    if s.run.is_writer:
        say(
            f"{cfg.name}: mesh {mesh_text} on {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s), {jax.process_count()} process(es); run directory {s.run.path}"
        )


def faults_and_tiers(s: Session, specs: list) -> tuple[Faults, list[Tier]]:
    """This process's injected faults (`specs`) and the restore tiers, whose commits they hook."""
    inject = Faults(specs, s.run, groups.run_process_index())  # the job-wide index
    setup = TierSetup(
        s.cfg, s.run, s.mesh, s.program.abstract_state,
        per_replica_params=s.program.sync_step is not None,  # DiLoCo
        before_commit=inject.before_commit, before_snapshot=inject.before_snapshot,
        tidy_checkpoints=groups.tidies_checkpoints(),
    )  # fmt: skip
    tiers = build_tiers(setup)
    inject.wait_for_saves = tiers[-1].checkpointer.wait  # `corrupt` must see the newest save
    return inject, tiers


def arm_faults(inject: Faults, tiers: list[Tier]) -> None:
    """After the restore (the local tier has met the other processes): what the faults act on."""
    local = next((t for t in tiers if t.name == "local"), None)
    tier = local.snapshots if local is not None else None
    inject.node = (tier.node_index(), tier.nodes, tier.node) if tier else None
    inject.wait_for_snapshot = tier.wait if tier else None


def _run_locked(
    s: Session, specs: list, t_start: float, progress: bool | None, early: tuple | None = None
) -> dict:
    cfg = s.cfg
    begin_incarnation(s)
    inject, tiers = faults_and_tiers(s, specs)
    persistent = tiers[-1]
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpar-compile")
    last = None
    try:
        state, compiled = restore_and_compile(s, tiers, pool, early)
        if groups.active():  # the other groups' live state, when they are training already
            s.link = groups.GroupLink(compiled, s.program.sync_every, s.run, inject)
            state = s.link.join(state)
        arm_faults(inject, tiers)
        s.tb = TensorBoardWriter(s.run) if cfg.log.tensorboard else None
        hooks = _hooks(s, tiers, inject, int(state["step"]), progress)
        try:
            last = _loop(s, persistent, hooks, compiled, state, t_start)
        except BaseException as e:
            inject.name_in(e)  # an error an injected fault caused names it (fault_kinds.raises)
            raise
    finally:
        pool.shutdown(wait=False)  # after an error, do not wait for a compile nobody needs
        failed = sys.exc_info()[0] is not None
        for t in reversed(tiers):  # the persistent checkpoints first: they hold the final state
            t.close(complete=last == cfg.train.steps, failed=failed)
        if s.tb:
            s.tb.close()
        if s.link is not None:
            s.link.close(complete=last == cfg.train.steps)
    s.run.event(WorkerEvent.DONE, step=last, complete=last == cfg.train.steps)
    summary = summarize(s.run, time.time() - t_start)
    if s.run.is_writer and not os.environ.get("JAXPAR_SUPERVISED"):
        write_json(s.run.file(runlog.SUMMARY), summary)
    return summary


def restore_and_compile(
    s: Session, tiers: list[Tier], pool: concurrent.futures.Executor, early: tuple | None = None
) -> tuple[dict, Any]:
    """(the starting state, the compiled train step): the newest state of the tiers, else a
    fresh one, while `pool` compiles (or loads) the step and warms up the tiers — both need only
    the abstract state, and orbax's reads release the GIL. Then the `compiled` event, the tiers
    ready, and a barrier: the first step's collectives start together. `early`: a standby's
    step, compiled before its "go"."""
    step_program = pool.submit(compile_step, s) if early is None else None
    warm = [pool.submit(t.warm_up) for t in tiers]
    state, restored = restore_newest(tiers, _first_state(s))
    if s.init_from is not None and restored is not None:
        s.init_from().close()
    if s.init_from is not None and restored is not None and jax.process_index() == 0:
        say(f"--init-from {s.init_text} not read: resuming from the {restored.tier} state at step "
            f"{restored.step} (a run directory's own state wins)")  # fmt: skip
    compiled, seconds = step_program.result() if early is None else early
    for t, warmed in zip(tiers, warm, strict=True):
        warmed.result()
        t.ready()
    bootstrap.barrier("jaxpar_compiled")
    # every program of every process is ready (the step, the checkpoint's checksums, the
    # snapshot's copy): what comes after the event is the first step itself
    s.run.event(
        WorkerEvent.COMPILED, seconds=seconds, ahead=early is not None, **compile_cache.stats()
    )
    for t in tiers:  # what saving needs later: compiled behind the first steps
        pool.submit(t.warm_behind)
    return state, compiled


def _hooks(
    s: Session, tiers: list[Tier], inject: Faults, start: int, progress: bool | None
) -> Hooks:
    """What runs around each step, in this order (the order of its events and syncs)."""
    cfg = s.cfg
    show = cfg.log.progress if progress is None else progress
    bar = Progress(cfg.train.steps, start, enabled=show and s.run.is_writer)
    unit = "tok" if s.source.kind == "lm" else "samples"
    hooks = Hooks()

    # -- before step: process faults, then the heartbeat (`step` steps done, arrived at the
    # next; before any cross-process sync, so a slow process shows up late here, stragglers, and
    # a hung one not at all), then faults on the state the step will run on
    def state_faults(c: StepContext) -> None:
        c.state = inject.on_state(c.step, c.state)

    hooks.add("faults", lambda c: inject.before_step(c.step), when=BEFORE)
    hooks.add("heartbeat", lambda c: bootstrap.heartbeat(s.run.path, c.step), when=BEFORE)
    hooks.add("state_faults", state_faults, when=BEFORE)

    # -- after step (its loss finite): metrics, progress, checkpoint, local tier, evaluation
    def metrics(c: StepContext) -> None:
        if s.link is not None and not s.link.leads:  # the quorum's lowest group writes
            return
        s.run.metrics(c.line)
        if s.tb:
            s.tb.write(c.line)

    def show_progress(c: StepContext) -> None:
        line = c.line
        rate = line.get("tokens_per_s") or line.get("samples_per_s")
        bar.update(c.step, line["loss"], rate, unit, loss_metrics(line))

    def evaluation(c: StepContext) -> None:
        ev = evaluate(s, c.state, c.step)
        shown = " ".join(f"{k} {v:.4f}" for k, v in ev.items() if k.startswith("eval_"))
        bar.message(f"step {c.step}: {shown}")

    last = cfg.train.steps
    hooks.add("metrics", metrics, due=lambda n: n % cfg.log.every == 0 or n == last)
    hooks.add("progress", show_progress)

    def leads() -> bool:  # replica groups: the quorum's lowest group saves
        return s.link is None or s.link.leads

    for t in reversed(tiers):  # the persistent checkpoint, then the local snapshot, as ever
        hooks.add(
            f"tier_{t.name}", lambda c, t=t: t.save(c.step, c.state),
            due=lambda n, t=t: t.due(n) and leads(),
        )  # fmt: skip
    if cfg.train.eval_every:
        hooks.add("evaluation", evaluation, every=cfg.train.eval_every)
    return hooks


def _loop(s, persistent: PersistentTier, hooks: Hooks, compiled, state, t_start) -> int:
    """Train from the state's step to cfg.train.steps; returns the last step completed."""
    cfg = s.cfg
    ckpt = persistent.checkpointer
    start = int(state["step"])
    for step in range(start, cfg.train.steps):
        stop = _stop_requested(s, ckpt, step, t_start)
        if stop:
            if s.link is None or s.link.leads:  # replica groups: the lowest group saves
                persistent.save(step, state, force=True)
            ckpt.wait()
            kind = WorkerEvent.PREEMPTED if stop == "preempted" else WorkerEvent.WALL_TIME_LIMIT
            s.run.event(kind, step=step, all_processes=True)  # each process: the step it saved
            if stop == "preempted":
                if ckpt.interrupted:
                    msg = f"interrupted at step {step}; checkpoint saved"
                    raise Preempted(msg, step, interrupted=True, run_dir=s.run.path)
                raise Preempted(f"preempted at step {step}; saved", step)
            return step
        ctx = StepContext(s, state, step)
        hooks.run(BEFORE, ctx)
        state = ctx.state
        batch = device_batch(s, step)
        t0 = time.time()
        if s.link is not None:  # a replica group: averaged across the quorum's groups
            state, m = s.link.train_step(state, batch)
        else:
            state, m = compiled(state, batch)
            if s.program.sync_every and (step + 1) % s.program.sync_every == 0:
                state = s.program.sync_step(state)  # DiLoCo: average replicas, outer step
        m = jax.device_get(m)
        line = metrics_line(s, step + 1, m, time.time() - t0, state)
        if not np.isfinite(line["loss"]):
            s.run.event(WorkerEvent.NONFINITE, step=step + 1, loss=line["loss"])
            raise NonFiniteLoss(step + 1, line["loss"])
        ctx = StepContext(s, state, step + 1, line)
        hooks.run(AFTER, ctx)
        state = ctx.state
    return max(start, cfg.train.steps)


def supervised_layout(cfg: TrainConfig, preset: Preset) -> tuple[TrainConfig, Preset]:
    """The mesh and microbatches `jaxpar launch` chose after an elastic shrink
    (JAXPAR_MESH, JAXPAR_MICROBATCHES), over the command line's; the rules tables stay."""
    mesh, micro = os.environ.get(bootstrap.ENV_MESH), os.environ.get(bootstrap.ENV_MICROBATCHES)
    if mesh:
        preset = dataclasses.replace(preset, mesh=MeshSpec.parse(mesh))
    if micro:
        train = dataclasses.replace(cfg.train, microbatches=int(micro))
        cfg = dataclasses.replace(cfg, train=train)
    return cfg, preset


def with_overrides(cfg: TrainConfig, steps: int | None) -> TrainConfig:
    if steps is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    return cfg
