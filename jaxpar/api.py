"""The library API for a user's own training entrypoint (re-exported from `jaxpar`).

`build` and `Job` (the sharded, compiled steps), `fit` (the whole supervised loop),
`CheckpointManager` and `entrypoint` (devices, jax.distributed, the exit codes `jaxpar launch`
reads). Usage, with a complete entrypoint: docs/api.md.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxpar.worker import bootstrap

# --- layouts -------------------------------------------------------------------------------------


def preset(name_or_spec: Any = "") -> Any:
    """A named preset (`"fsdp8"`, `"dp2_tp4"`, ...; see jaxpar.meshes.PRESETS), an unnamed
    preset with the default rules for a mesh spec (`"data=2,tensor=4"`; `""` = all devices on
    `data`), or a `Preset` / `MeshSpec` given as is."""
    from jaxpar import meshes
    from jaxpar.engine.mesh import MeshSpec
    from jaxpar.engine.rules import Preset

    if isinstance(name_or_spec, Preset):
        return name_or_spec
    if isinstance(name_or_spec, MeshSpec):
        return Preset(name_or_spec)
    return meshes.resolve(name_or_spec)


def build_mesh(layout: Any = "", devices: Sequence | None = None) -> Any:
    """The 4-D jax Mesh (data, fsdp, tensor, pipeline) of a preset name, spec, Preset or
    MeshSpec, over `devices` (default: all global devices)."""
    from jaxpar.engine.mesh import make_mesh

    return make_mesh(preset(layout).mesh, list(devices) if devices is not None else None)


# --- one job: sharded state and compiled steps ---------------------------------------------------


@dataclass
class Job:
    """A config compiled for one mesh: shardings, a sharded init, a train and an eval step.

    `train_step(state, batch) -> (state, metrics)` and `eval_step(state, batch) -> metrics` are
    jitted with the state's shardings; the train step donates its input state.
    """

    cfg: Any  # TrainConfig
    preset: Any  # Preset
    mesh: Any  # jax.sharding.Mesh
    source: Any  # jaxpar.data.sources.Source
    program: Any  # jaxpar.parallel.program.Program
    train_step: Callable[[dict, dict], tuple[dict, dict]]
    eval_step: Callable[[dict, dict], dict]

    @property
    def abstract_state(self) -> dict:
        """ShapeDtypeStructs of the state carrying its target shardings (a restore target)."""
        return self.program.abstract_state

    @property
    def state_shardings(self) -> dict:
        return self.program.state_shardings

    def init(self) -> dict:
        """A fresh state created directly in its shardings (jit with out_shardings)."""
        return self.program.init()

    def batch(self, step: int, split: str = "train") -> dict:
        """The global batch of `step` from the config's data source, sharded for the step
        (each process loads only its rows; a pure function of the seed and step)."""
        from jaxpar.data import sources as data_lib
        from jaxpar.worker import groups

        index, count = groups.batch_rows()  # a replica group's rows: its share of the batch
        local = data_lib.host_batch(
            self.source, step=step, global_batch=self.cfg.data.global_batch,
            seed=self.cfg.data.seed, process_index=index, process_count=count, split=split,
        )  # fmt: skip
        return self.device_batch(local)

    def device_batch(self, host_rows: dict) -> dict:
        """A global batch from this process's rows of your own data (numpy arrays whose first
        dimension is global_batch / process_count), sharded for the step."""
        from jaxpar.data import sources as data_lib
        from jaxpar.worker import groups

        rows = self.cfg.data.global_batch // groups.group_count()  # a replica group's share
        return data_lib.to_device(host_rows, self.program.batch_shardings, rows)

    def metrics_line(
        self, step: int, metrics: dict, seconds: float, state: dict | None = None
    ) -> dict:
        """The metrics line `jaxpar train` writes for a step (pass it to `RunDir.metrics`):
        `step` (steps completed), `loss`, `step_time_s` (`seconds`), samples/s or tokens/s, MFU,
        device memory, every metric of the step (`lr`, `grad_norm`, the loss's own), `time`.
        With a recipe's own optimizer the step returns no `lr`: given the `state` after the
        step, the line takes it from an `optax.inject_hyperparams` optimizer state."""
        from jaxpar.worker import training

        return training.metrics_line(self._view, step, metrics, seconds, state)

    @functools.cached_property
    def _view(self) -> Any:
        return self._loop_session()

    def _loop_session(self, run: Any = None) -> Any:
        """The training loop's view of this job (jaxpar.worker.training.Session) writing `run`
        (a RunDir; None: one that writes nothing)."""
        import jax

        from jaxpar.rundir.writer import peak_flops
        from jaxpar.worker import training

        return training.Session(
            self.cfg, self.preset, self.mesh, self.source, self.program, run,
            training.flops_per_step(self.cfg, self.source),
            peak_flops(jax.devices()[0].device_kind),
            lr_path=training.injected_lr_path(self.program),
        )  # fmt: skip

    def _use_compiled(self, compiled: Callable) -> None:
        """Run `train_step` as `compiled` (the same step, compiled ahead of its first call)."""
        self.train_step = (
            _with_sync(compiled, self.program) if self.program.sync_every else compiled
        )


def build(cfg: Any, mesh: Any = None, *, devices: Sequence | None = None) -> Job:
    """Compile `cfg` for a layout (preset name, spec, Preset or MeshSpec; default `cfg.mesh`).

    Nothing is allocated here: the model is built abstractly (eval_shape), its shardings come
    from the preset's rules, and `Job.init()` creates the state already sharded.
    """
    import jax

    from jaxpar.data import sources as data_lib
    from jaxpar.engine.mesh import make_mesh
    from jaxpar.engine.rules import validate_rules
    from jaxpar.parallel.program import build_program
    from jaxpar.worker import groups
    from jaxpar.worker.training import make_source, supervised_layout

    # after an elastic shrink, `jaxpar launch`'s mesh and microbatches (as for `fit`)
    cfg, layout = supervised_layout(cfg, preset(cfg.mesh if mesh is None else mesh))
    validate_rules(layout.params)
    validate_rules(layout.acts)
    m = make_mesh(layout.mesh, list(devices) if devices is not None else None)
    source = make_source(cfg)
    gcfg = groups.group_cfg(cfg, m)  # under `jaxpar launch --groups`: a group's share of the batch
    spec = data_lib.batch_spec(source, gcfg.data.global_batch)
    program = build_program(gcfg, m, layout.params, layout.acts, spec, source.kind)
    raw = program.train_step

    def train_step(state, batch):
        return raw(state, batch)

    # The engine's jitted step fixes the shardings of what goes in and out.
    step = jax.jit(train_step, donate_argnums=0)
    if program.sync_every:  # DiLoCo: the outer synchronisation belongs to the step's contract
        step = _with_sync(step, program)
    return Job(cfg, layout, m, source, program, step, program.eval_step)


def _with_sync(step: Callable, program: Any) -> Callable:
    def train_step(state, batch):
        state, metrics = step(state, batch)
        if int(state["step"]) % program.sync_every == 0:
            state = program.sync_step(state)
        return state, metrics

    return train_step


def from_hf(folder: str, mesh: Any = None, *, seq_len: int | None = None) -> tuple[Any, Any]:
    """(TrainConfig, model) of a Hugging Face checkpoint folder (LlamaForCausalLM,
    MistralForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM): the recipe
    `--recipe hf:DIR` builds (its model config from config.json) and the nnx model holding the
    folder's weights, in evaluation mode, callable on token ids (`model(tokens_BT)` -> logits;
    `init_cache`/`decode` for generation).

    Every file and tensor is checked before an array is built, then each parameter is streamed
    onto its sharding: `mesh` a preset name, a mesh spec ("fsdp=8"), a Preset or MeshSpec (its
    rules shard the parameters), or a jax Mesh (the default rules); None: the first device.
    `seq_len`: the model's context (default: max_position_embeddings, at most 2048 and the
    sliding window)."""
    import jax
    from flax import nnx

    from jaxpar.engine import model as model_lib
    from jaxpar.engine.mesh import MeshSpec, make_mesh
    from jaxpar.engine.rules import Preset
    from jaxpar.hf import config as hf_config
    from jaxpar.hf import load as hf_load
    from jaxpar.parallel.program import param_shardings

    cfg = hf_config.recipe(folder, seq_len)
    if mesh is None:
        layout = preset("data=1")
        m = make_mesh(layout.mesh, [jax.devices()[0]])
    elif isinstance(mesh, jax.sharding.Mesh):
        layout, m = Preset(MeshSpec(**dict(mesh.shape))), mesh
    else:
        layout = preset(mesh)
        m = build_mesh(layout)
    mdef = model_lib.abstract(cfg.model, cfg.train.seed)
    with hf_load.open_folder(folder, expect=cfg.model) as f:
        hf_load.check_abstract(f, nnx.to_pure_dict(mdef.params))
        params = hf_load.load_params(f, param_shardings(mdef.params, layout.params, m))
    model = model_lib.rebuild(mdef, params, None, None)
    model.eval()
    return cfg, model


# --- checkpoints ---------------------------------------------------------------------------------


class CheckpointManager:
    """jaxpar's checkpoints for a loop of your own: asynchronous Orbax saves of a whole state
    pytree with per-array checksums in `RUN_DIR/checkpoints/`, restorable onto any mesh or
    process count, and the run directory's records that `jaxpar launch`, summary.json and
    `jaxpar report` read.

    `config` (a TrainConfig), when given, is recorded and checked on restore: a checkpoint of
    another model/optimizer/data config is refused unless `force=True`.

    `job` (from `jaxpar.build`) makes the manager the run's bookkeeping, as `jaxpar train`
    keeps it: it takes the run directory (its lock, config.json, the incarnation) and writes
    `start`; `restore_or_init()` restores the newest state of the restore tiers (`restore`
    event, with its tier) while the train step is compiled through the run's compiled-program
    cache (`compiled`; a restarted process loads it); `before_step(step, state)` writes the
    progress heartbeat and runs `--fault` specs; `after_step(step, state)` saves through every
    tier that is due; `close()` writes `done` (and summary.json when not under `jaxpar
    launch`). Nothing is written before the checks of `jaxpar train` have passed.
    `local=True` adds the local tier: a snapshot in node RAM every `cfg.ckpt.local_every` steps
    (-1 or 0: by state size), restored first after a failure.
    `keep` and `use_async` default to the config's (`cfg.ckpt`) with a job, else 3 and True.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        keep: int | None = None,
        use_async: bool | None = None,
        config: Any = None,
        job: Job | None = None,
        local: bool = False,
    ):
        import jax

        from jaxpar import __version__
        from jaxpar.config import config_hash
        from jaxpar.recovery.checkpoint import Checkpointer
        from jaxpar.rundir.writer import RunDir
        from jaxpar.worker import standby

        standby.wait_for_go()  # a standby's entrypoint got here first: nothing written before "go"
        self._job, self._tiers, self._lock = job, None, None
        self._last: int | None = None  # the newest step restored, saved or completed
        self._stopping = False  # a preemption was reached: the loop saves and exits
        self._closed = False
        if job is not None:
            self._open(run_dir, job, keep, use_async, local)
            return
        if local:
            raise ValueError(
                "CheckpointManager(local=True) needs the job its snapshots are laid out for: "
                "CheckpointManager(run_dir, job=jaxpar.build(cfg, mesh), local=True)"
            )
        meta: dict[str, Any] = {"jaxpar_version": __version__, "nproc": jax.process_count()}
        if config is not None:
            meta["config_hash"] = config_hash(config)
        self.run = RunDir(run_dir, jax.process_index())
        self._ckpt = Checkpointer(self.run, every=0, keep=3 if keep is None else keep,
                                  meta=meta, use_async=True if use_async is None else use_async)  # fmt: skip

    def _open(
        self, run_dir: str, job: Job, keep: int | None, use_async: bool | None, local: bool
    ) -> None:
        import dataclasses
        import time

        from jaxpar.rundir.writer import RunDir
        from jaxpar.worker import groups, training

        c = job.cfg.ckpt
        every = (c.local_every or -1) if local and not groups.active() else 0
        ckpt = dataclasses.replace(
            c, keep=c.keep if keep is None else keep, local_every=every,
            use_async=c.use_async if use_async is None else use_async,
        )  # fmt: skip
        inc = os.environ.get(bootstrap.ENV_INCARNATION)
        run = RunDir(run_dir, groups.run_process_index(), int(inc) if inc else None, create=False)
        self._session = s = job._loop_session(run)
        s.cfg = dataclasses.replace(job.cfg, ckpt=ckpt)
        self._t0 = time.time()
        # every check that can refuse the run before anything is written; the faults of
        # `jaxpar launch --fault` (JAXPAR_FAULTS)
        specs = training.preflight(s.cfg, run_dir, [])
        self._lock = training.take_lock(s)
        try:
            training.begin_incarnation(s)  # config.json, the incarnation, `start`
            self._inject, self._tiers = training.faults_and_tiers(s, specs)
        except BaseException:
            self._release()
            raise
        self.run = run
        self._ckpt = self._tiers[-1].checkpointer

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def directory(self) -> str:
        return self._ckpt.directory

    def save(self, step: int, state: dict) -> float:
        """Start saving `state` as `step`; returns the seconds the caller was blocked."""
        self._last = step
        return self._ckpt.save(step, state)

    def wait(self) -> None:
        """Block until the save in flight has committed."""
        self._ckpt.wait()

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return self._ckpt.committed_steps()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(self, target: dict, step: int | None = None, *, force: bool = False):
        """The newest good checkpoint (or `step`) placed onto `target`'s shardings: a pytree of
        `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` for the mesh you restore onto, e.g.
        `Job.abstract_state`. A damaged checkpoint is skipped for the next older one (latest
        only). Returns the state (and writes the `restore` event), or None when there is no
        checkpoint."""
        import jax

        from jaxpar.engine.mesh import MeshSpec
        from jaxpar.rundir.runlog import WorkerEvent

        got = self._ckpt.restore(target, which="latest" if step is None else str(step),
                                 force=force)  # fmt: skip
        if got is None:
            return None
        state, meta = got
        sharding = getattr(jax.tree.leaves(target)[0], "sharding", None) if target else None
        mesh = getattr(sharding, "mesh", None)
        self.run.event(
            WorkerEvent.RESTORE, step=int(meta["step"]), tier="persistent",
            from_mesh=meta.get("mesh"), to_mesh=str(MeshSpec(**dict(mesh.shape))) if mesh else None,
            from_nproc=meta.get("nproc"), to_nproc=jax.process_count(),
            skipped_corrupt=meta.get("skipped", []),
        )  # fmt: skip
        self._last = int(meta["step"])
        return state

    def restore_or_init(self, *, init_from: str | None = None) -> dict:
        """(With `job`.) The newest usable state of the restore tiers — a local snapshot when
        `local=True` and it is at least as new as the newest checkpoint, else the checkpoint,
        resharded onto the job's mesh — else `job.init()`. The train step is compiled (or loaded
        from `RUN_DIR/compiled`) meanwhile and `job.train_step` runs it from now on. Writes
        `restore` (with its tier) and `compiled`.

        `init_from="hf:DIR"`: when no tier holds a state, the first state's parameters come
        from that Hugging Face checkpoint folder (checked against the job's model config, then
        streamed onto the job's shardings), its optimizer state initialised as usual; a state in
        the run directory wins (one line says so) and the folder is then not read."""
        import concurrent.futures

        from jaxpar.worker import groups, training

        if self._tiers is None:
            raise ValueError(
                "restore_or_init() restores for a job: CheckpointManager(run_dir, job=job); "
                "without one, use restore(job.abstract_state) or job.init()"
            )
        if init_from:
            from jaxpar.hf import load as hf_load

            path = hf_load.source_folder(init_from)
            model = self._session.cfg.model
            self._session.init_from = lambda: hf_load.open_folder(path, expect=model)
            self._session.init_text = init_from
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpar-compile")
        try:
            state, compiled = training.restore_and_compile(self._session, self._tiers, pool)
        finally:
            pool.shutdown(wait=False)  # after an error, do not wait for a compile nobody needs
        if groups.active():  # a replica group: the other groups' live state when they train
            link = groups.GroupLink(compiled, self._job.program.sync_every, self.run)
            self._session.link = self._job._view.link = link  # `quorum` in metrics lines
            state = link.join(state)
            self._job.train_step = link.train_step
        else:
            self._job._use_compiled(compiled)
        training.arm_faults(self._inject, self._tiers)
        self._last = int(state["step"])
        return state

    def before_step(self, step: int, state: dict) -> dict:
        """(With `job`.) Step `step` (0-based) is about to run on `state`: the progress
        heartbeat `jaxpar launch` watches for hangs and stragglers (`jaxpar.heartbeat`), and the
        faults injected with `jaxpar launch --fault`. Returns the state to run the step on."""
        if self._tiers is None:
            raise ValueError(
                "before_step() belongs to a job's loop: CheckpointManager(run_dir, job=job); "
                "without one, call jaxpar.heartbeat(run_dir, step)"
            )
        self._inject.before_step(step)
        bootstrap.heartbeat(self.run.path, step)
        return self._inject.on_state(step, state)

    def after_step(self, step: int, state: dict) -> None:
        """(With `job`.) `step` steps are complete: save `state` through every tier that is
        due — a checkpoint every `cfg.ckpt.every` steps and at the last step, then the local
        snapshot (`local=True`)."""
        if self._tiers is None:
            raise ValueError(
                "after_step() saves through a job's tiers: CheckpointManager(run_dir, job=job)"
            )
        link = self._session.link  # replica groups: the quorum's lowest group saves
        for tier in reversed(self._tiers):  # the persistent checkpoint, then the local snapshot
            if tier.due(step) and (link is None or link.leads):
                tier.save(step, state)
        self._last = step

    def reached_preemption(self, step: int) -> bool:
        """True when a preemption notice (SIGTERM) arrived: save `step` and exit with
        `jaxpar.EXIT_PREEMPTED` (all processes agree on the step). Also raises the error of a
        background save that failed (a full disk)."""
        self._ckpt.check()
        if self._ckpt.reached_preemption(step):
            self._stopping = True
            return True
        return False

    def close(self, *, failed: bool | None = None) -> None:
        """Finish the saves in flight and close the tiers (once; later calls do nothing). With
        `job`, a loop that ended without an error (`failed`; default: whether an exception is
        being handled) or a preemption writes `done` (and summary.json when not under `jaxpar
        launch`)."""
        if self._closed:
            return
        self._closed = True
        if self._tiers is None:
            self._ckpt.close()
            return
        import time

        from jaxpar.rundir import runlog
        from jaxpar.rundir.writer import summarize

        failed = sys.exc_info()[0] is not None if failed is None else failed
        complete = self._last is not None and self._last >= self._session.cfg.train.steps
        try:
            for tier in reversed(self._tiers):  # the persistent checkpoints first: final state
                tier.close(complete=complete, failed=failed)
            if self._session.link is not None:
                self._session.link.close(complete=complete)
        finally:
            self._release()
        if failed or self._stopping:
            return
        self.run.event(runlog.WorkerEvent.DONE, step=self._last, complete=complete)
        if self.run.is_writer and not os.environ.get(bootstrap.ENV_SUPERVISED):
            summary = summarize(self.run, time.time() - self._t0)
            runlog.write_json(self.run.file(runlog.SUMMARY), summary)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self._job is not None:
            self._inject.name_in(exc)  # an error an injected fault caused names it
        self.close(failed=exc_type is not None)


# --- the loop and the entrypoint -----------------------------------------------------------------


def resolve_run_dir(run_dir: str | None, cfg: Any) -> str:
    """`run_dir` if given, else JAXPAR_RUN_DIR (set by `jaxpar launch --run-dir`), else
    runs/NAME-TIME."""
    import time

    return (
        run_dir
        or os.environ.get(bootstrap.ENV_RUN_DIR)
        or os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    )


def fit(
    cfg: Any,
    mesh: Any = None,
    run_dir: str | None = None,
    *,
    faults: Sequence[str] = (),
    progress: bool | None = None,
    init_from: str | None = None,
) -> dict:
    """Train `cfg` to `cfg.train.steps` with everything `python -m train` does: sharded init or
    resharded restore of the newest good checkpoint in `run_dir`, metrics.jsonl / events.jsonl /
    TensorBoard, periodic asynchronous saves, evaluation, progress heartbeats for `jaxpar
    launch`, and a coordinated save on preemption (then `Preempted` is raised; `entrypoint`
    turns it into the exit code the supervisor expects). Returns the summary dict.

    `run_dir`: see `resolve_run_dir`. `init_from="hf:DIR"`: start from a Hugging Face
    checkpoint's weights (`--init-from`; a checkpoint in `run_dir` wins).
    """
    from jaxpar.worker import training

    run_dir = resolve_run_dir(run_dir, cfg)
    layout = preset(cfg.mesh if mesh is None else mesh)
    summary = training.run(cfg, layout, run_dir, faults=list(faults), progress=progress,
                           init_from=init_from)  # fmt: skip
    summary["run_dir"] = os.path.abspath(run_dir)
    return summary


def run_worker(fn: Callable[[], int | None]) -> int:
    """Run `fn` as a jaxpar worker and return its exit code (see `entrypoint`).

    The code is meant for the process's exit: after a Ctrl-C has saved and stopped the run
    (130), a further Ctrl-C while the process exits ends it at once, quietly."""
    try:
        return _run_worker(fn)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves on it)
        print("jaxpar: interrupted; nothing more was saved", file=sys.stderr)
        return EXIT_INTERRUPTED


EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it


def _exit_on_next_interrupt() -> None:
    """The checkpoint is saved and the process is on its way out: a second Ctrl-C now (the
    checkpointer has put back the previous handler) would raise KeyboardInterrupt somewhere in
    the interpreter's shutdown and print its traceback. It exits at once instead."""

    def stop(signum, frame) -> None:
        print("jaxpar: interrupted again: stopping now", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, stop)


def _run_worker(fn: Callable[[], int | None]) -> int:
    from jaxpar.worker import standby

    bootstrap.configure_devices()
    # a standby writes nothing to the run directory before "go" (its stack-dump file comes then)
    bootstrap.initialize_from_env(stack_dump=not standby.pending())
    from jaxpar.recovery.checkpoint import (
        CheckpointMismatch,
        NonFiniteState,
        Preempted,
        ReplicaMismatch,
        disk_full_path,
        is_disk_full,
    )
    from jaxpar.rundir import ownership
    from jaxpar.worker.faults import NonFiniteLoss
    from jaxpar.worker.training import NothingToDo

    # guard(): any other error in a multi-process job exits at once (EXIT_COLLECTIVE for a
    # collective error) instead of waiting in jax's shutdown barrier for a dead peer.
    with bootstrap.guard():
        try:
            return fn() or 0
        except NothingToDo as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return 0
        except Preempted as e:
            if e.interrupted and not os.environ.get(bootstrap.ENV_SUPERVISED):
                resume = ownership.resume_command(e.run_dir) if e.run_dir else ""
                print(f"jaxpar: {e}; resume with: {resume}", file=sys.stderr)
                _exit_on_next_interrupt()
                return EXIT_INTERRUPTED
            print(f"jaxpar: {e}", file=sys.stderr)
            return bootstrap.EXIT_PREEMPTED
        except (NonFiniteLoss, NonFiniteState) as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return bootstrap.EXIT_NAN
        except ReplicaMismatch as e:
            print(f"jaxpar: {e}", file=sys.stderr)
            return bootstrap.EXIT_REPLICA
        except Exception as e:
            if is_disk_full(e):  # one line, not orbax's tracebacks; restarting cannot help
                where = disk_full_path(e, os.environ.get(bootstrap.ENV_RUN_DIR) or os.getcwd())
                print(
                    f"jaxpar: no space left on device (ENOSPC) writing {where}; free space "
                    f"there and rerun the same command (committed checkpoints are intact)",
                    file=sys.stderr,
                )
                if bootstrap.distributed_active():  # orbax's threads may wait at a barrier for
                    sys.stdout.flush()  # the failed save: exit now, the supervisor stops the rest
                    sys.stderr.flush()
                    os._exit(bootstrap.EXIT_NO_SPACE)
                return bootstrap.EXIT_NO_SPACE
            if isinstance(e, CheckpointMismatch | ValueError):  # also RunDirLocked, bad config
                print(f"error: {e}", file=sys.stderr)
                return bootstrap.EXIT_USAGE
            raise


def entrypoint(fn: Callable[[], int | None]) -> None:
    """Run a user's `main()` under jaxpar's supervision contract and exit the process.

    Call it as the last line of your script, before anything has used a jax device:
    simulated CPU devices when there is no accelerator (JAXPAR_DEVICES_PER_PROC under
    `jaxpar launch`, else 8), `jax.distributed` from the environment (`jaxpar launch`, SLURM,
    Open MPI, Kubernetes), and exit codes the supervisor acts on: 0 done, 42 preempted after a
    save, 44 non-finite loss (roll back), 45 replicas disagree, 43 a peer is gone, 2 a usage
    error (not restarted). Progress heartbeats and the preemption save come from `fit`.
    """
    sys.exit(run_worker(fn))
