"""`jaxpar tune`: rank the layouts of N devices by a step time predicted from compiled programs.

    jaxpar tune --recipe gpt_tiny --devices 8 [--hardware cpu] [--measure 8] [--top 10] [--out F]
    jaxpar tune --recipe gpt_350m --target v5e-8    # compiled by XLA's TPU compiler, here

1. Enumerate: every way of writing N as a product of the mesh axes the model supports
   (jaxpar.engine.mesh.AXES; an axis no rule of the model's arrays uses is pruned with that
   reason), x the model's rematerialisation choices x gradient-accumulation microbatches x the
   pipeline schedules of the config (`pipeline.schedule`'s allowed values) where pipeline > 1.
   What cannot work is pruned with a reason: the batch does not split, a parameter does not
   divide, too few layers for the stages.
2. Compile: each mesh at the base settings, then the setting variants of the best meshes (and
   of any that does not fit), ahead of time for N devices. From each compiled program: memory per
   device (arguments, outputs, temporaries), FLOPs per device, collective bytes per mesh axis
   (jaxpar.engine.collectives), involuntary rematerializations (jaxpar.tools.doctor).
3. Predict on a hardware profile (jaxpar.tools.hardware): compute = FLOPs / (peak x efficiency);
   each axis's communication = wire bytes / bandwidth of the links it crosses + collectives x
   latency. Overlap rule: gradient traffic over the batch axes (data, fsdp) hides under the
   backward pass up to `overlap` x compute; every other axis's traffic is on the critical path;
   a pipeline adds its bubble, (p - 1) / (m + p - 1) of the compute for the fill-drain schedules.
   A layout whose memory exceeds the profile's does not fit and ranks last.

`--target NAME` (jaxpar.tools.targets): every layout is compiled by the target's own compiler
for its devices. A layout fits when that compiler says so (TPU: it refuses a program over its
HBM; CUDA: the peak against the card's memory); FLOPs, bytes and kernels are the target
program's, its loops counted by their trip count, and the collectives it scheduled to overlap
with computation hide under it (up to `overlap` x compute) whatever their axis.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpar.config import RANGES, TrainConfig, apply_overrides, validate
from jaxpar.engine import collectives
from jaxpar.engine.mesh import AXES, BATCH_AXES, HOST_AXES, MeshSpec, mesh_text
from jaxpar.engine.rules import ACT_RULES, PARAM_RULES, Preset
from jaxpar.parallel import pipeline
from jaxpar.rundir.ownership import check_file_path
from jaxpar.tools import doctor, hardware, targets
from jaxpar.worker.training import device_batch, setup

REMAT_CHOICES = ("none", "dots", "block")  # the model's own check prunes the ones it lacks
ACCUMULATION = (1, 2)  # train.microbatches tried
VARIANT_MESHES = 2  # meshes whose setting variants are compiled (plus any that does not fit)
PIPELINE = "pipeline"


@dataclass
class Layout:
    sizes: dict[str, int]
    settings: dict[str, object]
    fits: bool = True
    memory: dict = field(default_factory=dict)
    flops: float = 0.0
    axis_bytes: dict[str, float] = field(default_factory=dict)
    axis_count: dict[str, int] = field(default_factory=dict)
    remats: int = 0
    split: dict[str, float] = field(default_factory=dict)
    predicted_step_s: float = math.inf
    bottleneck: str = ""
    reason: str = ""
    measured_step_s: float | None = None
    compile_s: float = 0.0
    kernels: int = 0  # kernels one step launches per device (loop bodies x trip count)
    # --target: wire bytes per axis of the collectives its compiler overlaps with computation
    overlapped: dict[str, float] | None = None
    # pipeline: the FLOPs of `flops` a stage spends waiting on the others (its bubble), read from
    # the tick loop with the schedule's table (None: not a pipeline layout)
    wait_flops: float | None = None

    @property
    def mesh(self) -> str:
        live = {a: n for a, n in self.sizes.items() if n > 1}
        return mesh_text(live or {"data": 1})

    def overrides(self) -> list[str]:
        return setting_overrides(self.settings)

    def label(self) -> str:
        return f"{self.mesh} {' '.join(self.overrides())}".strip()

    def command(self, recipe: str, overrides: list[str] = (), verb: str = "train") -> str:
        """The command that runs this layout: the recipe as given, the overrides the search ran
        with, then the layout's settings (`verb`: train, or inspect)."""
        sets = "".join(f" --set {shlex.quote(o)}" for o in [*overrides, *self.overrides()])
        return f"jaxpar {verb} --recipe {shlex.quote(recipe)} --mesh {self.mesh}{sets}"

    def record(self) -> dict:
        out = {
            "mesh": self.mesh, "settings": self.settings, "fits": self.fits,
            "predicted_step_s": self.predicted_step_s, "memory_bytes": self.memory.get("peak") or 0,
            "memory": self.memory, "flops_per_device": self.flops,
            "collective_bytes": self.axis_bytes, "involuntary_remats": self.remats,
            "time_split_s": self.split, "bottleneck": self.bottleneck, "reason": self.reason,
        }  # fmt: skip
        if self.measured_step_s is not None:
            out["measured_step_s"] = self.measured_step_s
        return out


# --------------------------------------------------------------------------- enumeration


def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    """Ordered k-tuples of positive ints whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in _divisors(n) for rest in factorizations(n // d, k - 1)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def supported_axes(cfg: TrainConfig, probe, only=None) -> tuple[list[str], dict[str, str]]:
    """Mesh axes the model can use, and a reason for each one it cannot. `probe(sizes)` builds
    the program for a 2-device mesh on one axis and returns its parameter shardings (or raises
    ValueError with the model's reason). `only`: the axes asked for (--axes; data always)."""
    ok, pruned = [], {}
    for a in AXES:
        if only and a not in only and a != "data":
            pruned[a] = f"axis {a}: not in --axes"
            continue
        if a == "data":
            ok.append(a)
            continue
        act_axes = {x for _, axes in ACT_RULES for x in _as_tuple(axes)}
        try:
            specs = probe({a: 2})
        except ValueError as e:
            pruned[a] = f"axis {a}: {e}"
            continue
        if a in specs or (a in act_axes and a != PIPELINE):
            ok.append(a)
        else:
            pruned[a] = f"axis {a}: no rule places any of {cfg.name}'s arrays on it"
    return ok, pruned


def _as_tuple(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def setting_variants(cfg: TrainConfig, sizes: dict[str, int]) -> tuple[dict, list[dict]]:
    """(base settings, the variants that change one knob) of a mesh."""
    base: dict[str, object] = {}
    variants: list[dict] = []
    if hasattr(cfg.model, "remat"):
        base["model.remat"] = "none"
        variants += [{"model.remat": r} for r in REMAT_CHOICES if r != "none"]
    base["train.microbatches"] = 1
    variants += [{"train.microbatches": m} for m in ACCUMULATION if m != 1]
    p = sizes.get(PIPELINE, 1)
    if p > 1:
        base["pipeline.schedule"] = "gpipe"
        base["pipeline.microbatches"] = p
        variants += [{"pipeline.schedule": s} for s in RANGES["pipeline.schedule"] if s != "gpipe"]
        variants.append({"pipeline.microbatches": 2 * p})
    return base, [{**base, **v} for v in variants]


def check_layout(cfg: TrainConfig, sizes: dict[str, int], settings: dict) -> str | None:
    """Why the layout cannot work, before compiling (None: it may)."""
    ways = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    batch = cfg.data.global_batch
    if batch % ways:
        return f"global batch {batch} does not split {ways} ways over {'x'.join(BATCH_AXES)}"
    rows = batch // ways
    mb = int(settings.get("train.microbatches", 1))
    if rows % mb:
        return f"batch too small: {rows} rows per replica for {mb} microbatches"
    p = sizes.get(PIPELINE, 1)
    if p > 1:
        layers = getattr(cfg.model, "n_layers", None)
        if layers is None:
            return "pipeline: the model has no stacked layers"
        m = int(settings.get("pipeline.microbatches", p))
        reps = (
            2
            if str(settings.get("pipeline.schedule", "")).startswith(("circular", "interl"))
            else 1
        )
        if layers % (p * reps):
            return f"pipeline: {layers} layers do not split into {p} stages x {reps} groups"
        if (rows // mb) % m:
            return f"batch too small: {rows // mb} rows per replica for {m} pipeline microbatches"
    return None


def setting_overrides(settings: dict) -> list[str]:
    """A layout's settings as --set overrides (a schedule of layer groups: two per stage)."""
    overrides = [f"{k}={v}" for k, v in settings.items()]
    sched = str(settings.get("pipeline.schedule", ""))
    if sched.startswith(("circular", "interl")):
        overrides.append("pipeline.repeats=2")
    return overrides


def apply(cfg: TrainConfig, settings: dict) -> TrainConfig:
    return validate(apply_overrides(cfg, setting_overrides(settings)))


# --------------------------------------------------------------------------- compile and predict


def compile_layout(cfg: TrainConfig, lay: Layout, devices, run_dir: str,
                   target: targets.Target | None = None):  # fmt: skip
    """Compile the layout's step; fill memory, FLOPs, bytes per axis, remats. Returns
    (session, compiled). `target`: by the target's compiler, for its devices (raises
    targets.DoesNotFit when its compiler refuses the program for memory)."""
    preset = Preset(MeshSpec(**{a: lay.sizes.get(a, 1) for a in AXES}), PARAM_RULES, ACT_RULES)
    t0 = time.perf_counter()
    s = setup(apply(cfg, lay.settings), preset, run_dir, devices=devices, create=False)
    lowered = doctor.lower_step(s)
    floor = (s.flops_per_step or 0.0) / len(devices)  # the model's FLOPs split evenly
    switch = pipeline_table(s)
    if target is not None:
        res = targets.compile_lowered(target, lowered, s.mesh, switch)
        compiled, colls, hlo = res.compiled, res.colls, res.hlo
        lay.remats = len(res.remats)
        lay.flops = max(res.flops, floor)
        lay.overlapped = {}
        cost = collectives.hlo_cost(hlo, switch)
        lay.wait_flops = cost["wait_flops"]
    else:
        compiled, err = doctor.compile_warned(lowered)
        colls, hlo = collectives.audit(compiled, s.mesh), compiled.as_text()
        lay.remats = len(doctor.parse_warnings(err))
        # The dots and the elementwise work, each loop body times its trip count (XLA's cost
        # analysis counts a loop body once); the model's FLOPs split evenly are a floor.
        cost = collectives.hlo_cost(hlo, switch)
        lay.flops = max(cost["flops"] + cost["elementwise"], floor)
        lay.wait_flops = cost["wait_flops"] + cost["wait_elementwise"]
    lay.compile_s = time.perf_counter() - t0
    lay.kernels = kernel_count(hlo)
    lay.memory = collectives.memory(compiled)
    for c in colls:
        key = ",".join(c.mesh_axes) or "-"
        lay.axis_bytes[key] = lay.axis_bytes.get(key, 0.0) + c.wire_bytes * c.executions
        lay.axis_count[key] = lay.axis_count.get(key, 0) + c.executions
        if lay.overlapped is not None and c.overlapped:
            lay.overlapped[key] = lay.overlapped.get(key, 0.0) + c.wire_bytes * c.executions
    return s, compiled


def pipeline_table(s) -> np.ndarray | None:
    """[ticks, stages] branch each stage runs at each tick of the pipeline's loop (None: the
    session is not a pipeline layout)."""
    p = s.mesh.shape.get(PIPELINE, 1)
    if p == 1:
        return None
    parts = pipeline.model_parts(s.program.graphdef, s.program.param_template)
    sched = pipeline.make_schedule(s.cfg.pipeline, p, parts.num_layers)
    return pipeline.loop_branches(sched)


def kernel_count(hlo: str) -> int:
    """Kernels an optimised module launches per run (collectives.hlo_cost): the instructions of
    the computations that run on their own (not fusion bodies, reducers or sort comparators), a
    while body's counted trip-count times, a conditional's costliest branch once."""
    return round(collectives.hlo_cost(hlo)["kernels"])


def crosses_hosts(axis: str, sizes: dict[str, int], island: int) -> bool:
    """Whether an axis's groups leave an island: processes lie along HOST_AXES outermost first,
    so an axis crosses when the product of it and the axes inside it exceeds the island."""
    if axis not in HOST_AXES:
        return False
    inner = math.prod(sizes.get(a, 1) for a in AXES[AXES.index(axis) :])
    return inner > island


def predict(lay: Layout, prof: hardware.Profile, memory_bytes: float | None = None) -> None:
    """Step time, its split, the bottleneck and a one-line reason (overlap rule: module doc).
    `memory_bytes`: the device memory a layout must fit (default: the profile's)."""
    rate = prof.peak_flops * prof.efficiency
    p = lay.sizes.get(PIPELINE, 1)
    # a pipeline's waits read from its tick loop (module doc) are its bubble, not its compute
    waits = lay.wait_flops / rate if p > 1 and lay.wait_flops is not None else None
    compute = lay.flops / rate - (waits or 0.0)
    split = {"compute": compute}
    if prof.op_s or prof.step_s:
        split["overhead"] = lay.kernels * prof.op_s + prof.step_s
    hidden_budget = prof.overlap * compute
    exposed = 0.0
    for key, wire in sorted(lay.axis_bytes.items()):
        axes = key.split(",")
        bw = (
            prof.inter_bw
            if any(crosses_hosts(a, lay.sizes, prof.island) for a in axes)
            else prof.intra_bw
        )
        t = wire / bw + lay.axis_count.get(key, 0) * prof.latency_s
        split[f"comm:{key}"] = t
        if lay.overlapped is not None:  # a target's program: what its compiler overlaps
            hideable = t * lay.overlapped.get(key, 0.0) / wire if wire else 0.0
        else:
            hideable = t if set(axes) <= set(BATCH_AXES) else 0.0
        hide = min(hideable, hidden_budget)
        hidden_budget -= hide
        t -= hide
        exposed += t
    bubble = 0.0
    if waits is not None:
        bubble = waits
        split["bubble"] = bubble
    elif p > 1:
        m = int(lay.settings.get("pipeline.microbatches", p))
        v = (
            2
            if str(lay.settings.get("pipeline.schedule", "")).startswith(("circular", "interl"))
            else 1
        )
        bubble = compute * (p - 1) / (v * m + p - 1)
        split["bubble"] = bubble
    lay.split = split
    lay.predicted_step_s = compute + exposed + bubble + split.get("overhead", 0.0)
    lay.fits = (lay.memory.get("peak") or 0) <= (memory_bytes or prof.memory_bytes)
    parts = {k: v for k, v in split.items()}
    top = max(parts, key=parts.get)
    if not lay.fits:
        lay.bottleneck = "memory"
        lay.reason = f"needs {_gib(lay.memory['peak'])} per device, {prof.name} has {_gib(memory_bytes or prof.memory_bytes)}"
    elif top == "compute":
        lay.bottleneck = "compute"
        lay.reason = f"{lay.flops / 1e9:.2f} GFLOP per device; communication {sum(v for k, v in split.items() if k.startswith('comm')) * 1e3:.2f} ms"
    elif top == "overhead":
        lay.bottleneck = "kernel launches"
        lay.reason = f"{lay.kernels} kernels per step: {split['overhead'] * 1e3:.2f} ms of overhead"
    elif top == "bubble":
        lay.bottleneck = "pipeline bubble"
        lay.reason = f"{p} stages fill and drain: {bubble * 1e3:.2f} ms idle"
    else:
        key = top.split(":", 1)[1]
        lay.bottleneck = f"{key} communication"
        lay.reason = (
            f"{lay.axis_bytes[key] / 1e6:.2f} MB sent per device in {lay.axis_count.get(key, 0)} "
            f"collectives over {key}"
        )
    if lay.remats:
        lay.reason += f"; {lay.remats} involuntary rematerialization(s): jaxpar inspect --doctor"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# --------------------------------------------------------------------------- measure


def measure(s, compiled, steps: int = 5, times: list | None = None) -> float:
    """Median wall time of `steps` steps after two warm-up steps, on this machine (`times`:
    filled with each step's)."""
    return measure_all([(s, compiled)], steps, [times] if times is not None else None)[0]


def measure_all(runs: list[tuple], steps: int = 5, times: list | None = None,
                quantile: float = 0.5) -> list[float]:  # fmt: skip
    """Each (session, compiled) run's step time on this machine: two warm-up steps each, then
    `steps` rounds of one step of every run in turn, so that a load that comes and goes falls
    on every layout alike instead of on whichever ran then; the `quantile` of each run's
    times (`times`: one list per run, filled with its times)."""
    states = [s.program.init() for s, _ in runs]
    got: list[list[float]] = [[] for _ in runs]
    for i in range(steps + 2):
        for k, (s, compiled) in enumerate(runs):
            batch = device_batch(s, i)
            t0 = time.perf_counter()
            states[k], m = compiled(states[k], batch)
            jax.block_until_ready((states[k], m))
            if i >= 2:
                got[k].append(time.perf_counter() - t0)
    for k, one in enumerate(times or ()):
        one.extend(got[k])
    return [float(np.quantile(g, quantile)) for g in got]


MEASURE_ROUNDS = 7  # rounds of one step per measured layout
MEASURE_QUANTILE = 0.25  # a low quantile of each layout's steps: its speed, less the others' load


NOISY_PEAK = 0.2  # the machine's peak moved by more than this share while layouts ran
NOISY_SPREAD = 1.5  # a layout's slowest measured step over its fastest


def noise(prof: hardware.Profile, devices: int, spreads: list[float], target=None) -> dict:
    """Whether the measured times can be trusted: the `cpu` profile's peak measured again after
    the layouts ran, against the one the predictions used, and the spread of each layout's steps.
    The warning (None when neither moved) says what moved; other jobs on the machine are the
    usual cause, and then they, not the layouts, decide the measured ranking."""
    out = {"peak_before": prof.peak_flops, "peak_after": None, "step_spread": max(spreads),
           "load_average": _load(), "warning": None}  # fmt: skip
    if prof.name == "cpu" and target is None:
        out["peak_after"] = hardware.cpu_peak(devices)
    why = []
    if out["peak_after"] is not None:
        change = out["peak_after"] / prof.peak_flops - 1
        if abs(change) > NOISY_PEAK:
            why.append(f"this machine's peak moved {change:+.0%} while the layouts ran "
                       f"({prof.peak_flops / 1e9:.2f} -> {out['peak_after'] / 1e9:.2f} GFLOP/s "
                       f"per device)")  # fmt: skip
    if out["step_spread"] > NOISY_SPREAD:
        why.append(f"a layout's slowest step took {out['step_spread']:.1f}x its fastest")
    if why:
        load = out["load_average"]
        out["warning"] = (
            "warning: the measurements are noisy: "
            + "; ".join(why)
            + (f"; load average {load:.1f} on {os.cpu_count()} cores" if load is not None else "")
            + ". Other jobs' load, not the layouts, may decide the measured ranking: measure "
            "again on an idle machine"
        )
    return out


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = np.asarray(ranks(a)), np.asarray(ranks(b))
    if len(a) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def measure_picks(ranked: list[Layout], k: int) -> list[Layout]:
    """The top ceil(k/2) predictions and a spread of the rest (evenly spaced ranks)."""
    fits = [x for x in ranked if x.fits]
    top = fits[: (k + 1) // 2]
    rest = fits[len(top) :]
    want = k - len(top)
    if want <= 0 or not rest:
        return top
    idx = sorted({round(i * (len(rest) - 1) / max(want - 1, 1)) for i in range(want)})
    return top + [rest[i] for i in idx]


# --------------------------------------------------------------------------- the command


def tune(cfg: TrainConfig, devices: int | None, hardware_name: str | None = None,
         measure_k: int = 0, top: int = 10, out: str | None = None, log=print,
         axes: list[str] | None = None, target: str | None = None, recipe: str | None = None,
         overrides: list[str] | None = None) -> dict:  # fmt: skip
    """Enumerate, compile, predict, (measure), print and return the result dict. `target`: every
    layout compiled by that target's compiler for its devices, predicted on its profile.
    `recipe`, `overrides`: the --recipe and --set that gave `cfg`, for the printed commands
    (default: the config's name, none)."""
    t = targets.get(target) if target is not None else None
    if t is not None:
        if hardware_name not in (None, t.name):
            raise ValueError(
                f"--hardware {hardware_name} with --target {t.name}: a target is predicted on its "
                "own profile; drop --hardware"
            )
        if devices is not None and devices != t.devices:
            raise ValueError(
                f"--devices {devices}: target {t.name} has {t.devices} devices; drop --devices "
                f"or give {t.devices}"
            )
        if measure_k:
            raise ValueError(
                f"--measure runs layouts on this machine's devices, not on {t.name}'s; drop it "
                "(measure with --hardware cpu)"
            )
        devices, hardware_name = t.devices, t.name
    elif devices is None:
        raise ValueError("--devices: give the number of devices to lay out (or --target NAME)")
    hardware_name = hardware_name or "cpu"
    if t is None and (devices < 1 or devices > jax.device_count()):
        raise ValueError(
            f"--devices {devices}: this machine has {jax.device_count()} devices; use 1.."
            f"{jax.device_count()} (more simulated CPU devices: XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N)"
        )
    bad = [a for a in axes or () if a not in AXES]
    if bad:
        raise ValueError(f"--axes: unknown mesh axis {bad[0]!r}; use some of {', '.join(AXES)}")
    if hardware_name not in hardware.names():
        raise ValueError(
            f"unknown hardware profile {hardware_name!r}; use one of {', '.join(hardware.names())}"
        )
    if out:  # before minutes of compiling: a result that cannot be written is refused now
        for path in (out, os.path.splitext(out)[0] + ".png"):
            check_file_path(path)
    t_start = time.perf_counter()
    devs = targets.devices(t) if t is not None else jax.devices()[:devices]
    prof = hardware.get(hardware_name, devices)
    with tempfile.TemporaryDirectory() as tmp:
        given = (recipe or cfg.name, list(overrides or ()))
        result = _run(cfg, devs, prof, measure_k, top, tmp, log, axes, t, given)
    result["wall_s"] = time.perf_counter() - t_start
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        png = os.path.splitext(out)[0] + ".png"
        plot(result, png)
        log(f"\nwrote {out} and {png}")
    return result


def _probe(cfg, devs, run_dir):
    def probe(sizes):
        spec = MeshSpec(**{a: sizes.get(a, 1) for a in AXES})
        s = setup(cfg, Preset(spec, PARAM_RULES, ACT_RULES), run_dir, devices=devs[:2],
                  create=False)  # fmt: skip
        doctor.lower_step(s)  # tracing runs the model's own checks of the layout
        return {
            a
            for leaf in jax.tree.leaves(s.program.abstract_state)
            for entry in leaf.sharding.spec
            for a in _as_tuple(entry)
        }

    return probe


def _run(cfg, devs, prof, measure_k, top, tmp, log, only=None, target=None,
         given=None) -> dict:  # fmt: skip
    recipe, overrides = given or (cfg.name, [])
    n = len(devs)
    # CUDA: jaxpar compares the peak with the card; TPU: its compiler has already refused
    limit = None if target is None else target.memory_bytes if target.family == "cuda" else math.inf
    axes, pruned_axes = (
        supported_axes(cfg, _probe(cfg, devs, tmp), only) if n > 1 else (["data"], {})
    )
    pruned: list[dict] = [{"mesh": "-", "settings": {}, "reason": r} for r in pruned_axes.values()]
    meshes = []
    for combo in factorizations(n, len(axes)):
        sizes = dict(zip(axes, combo, strict=True))
        meshes.append(sizes)
    layouts: list[Layout] = []
    sessions: dict[int, tuple] = {}

    def try_compile(sizes, settings) -> Layout | None:
        lay = Layout(sizes, settings)
        why = check_layout(cfg, sizes, settings)
        if why is None:
            try:
                sessions[id(lay)] = compile_layout(cfg, lay, devs, tmp, target)
            except targets.DoesNotFit as e:  # the target's compiler refused it: ranks last
                refused(lay, str(e))
                return lay
            except ValueError as e:
                why = str(e).split("\n")[0]
        if why is not None:
            pruned.append({"mesh": lay.mesh, "settings": settings, "reason": why})
            return None
        predict(lay, prof, limit)
        layouts.append(lay)
        log(f"  compiled {lay.label():60s} {lay.compile_s:5.1f}s  predicted "
            f"{lay.predicted_step_s * 1e3:8.2f} ms")  # fmt: skip
        return lay

    def refused(lay: Layout, line: str) -> None:
        lay.fits, lay.bottleneck, lay.reason = False, "memory", line
        lay.memory = {"peak": targets.oom_bytes(line) or 0}
        layouts.append(lay)
        log(f"  compiled {lay.label():60s} {line}")

    log(f"# jaxpar tune: {cfg.name} on {n} devices, profile {prof.name}")
    if target is not None:
        log(f"compiled for {targets.describe(target)}; precision.compute="
            f"{cfg.precision.compute}")  # fmt: skip
    log(
        f"axes: {', '.join(axes)}"
        + (f" (pruned: {'; '.join(pruned_axes.values())})" if pruned_axes else "")
    )
    base_layouts = []
    for sizes in meshes:
        base, _ = setting_variants(cfg, sizes)
        lay = try_compile(sizes, base)
        if lay is not None:
            base_layouts.append(lay)
    if not base_layouts:
        reasons = sorted({p["reason"] for p in pruned})
        raise ValueError(
            f"no valid layout of {cfg.name} on {n} devices: {reasons[0] if reasons else '?'}; "
            f"try another --devices (a divisor of the global batch {cfg.data.global_batch})"
        )
    ranked = sorted(base_layouts, key=_key)
    chosen = ranked[:VARIANT_MESHES] + [x for x in ranked[VARIANT_MESHES:] if not x.fits]
    skipped = 0
    for lay in base_layouts:
        _, variants = setting_variants(cfg, lay.sizes)
        if lay in chosen:
            for v in variants:
                try_compile(lay.sizes, v)
        else:
            skipped += len(variants)
    ranked = sorted(layouts, key=_key)
    if not any(x.fits for x in ranked):
        raise ValueError(no_fit_message(cfg, ranked, prof, target))
    result: dict = {
        "recipe": cfg.name, "devices": n, "hardware": prof.as_dict(),
        "target": targets.as_dict(target) if target is not None else None,
        "precision_compute": cfg.precision.compute,
        "hardware_source": hardware.SOURCES.get(prof.name, ""),
        "overlap_rule": "batch-axis (data, fsdp) traffic hides under overlap x compute; other "
        "axes are exposed; pipelines add (p-1)/(v*m+p-1) x compute; kernels x per-kernel time "
        "and the per-step dispatch add on top",
        "layouts": [x.record() for x in ranked], "pruned": pruned,
        "not_compiled": f"{skipped} setting variants of meshes outside the best {VARIANT_MESHES} "
        "(remat and accumulation trade memory for time; these fit without them)",
        "winner_command": ranked[0].command(recipe, overrides),
    }  # fmt: skip
    if measure_k:
        picks = measure_picks(ranked, measure_k)
        log(f"\nmeasuring {len(picks)} layouts on this machine ...")
        times: list[list[float]] = [[] for _ in picks]
        got = measure_all([sessions[id(lay)] for lay in picks], MEASURE_ROUNDS, times,
                          MEASURE_QUANTILE)  # fmt: skip
        spreads = [max(t) / min(t) for t in times]
        for lay, step_s in zip(picks, got, strict=True):
            lay.measured_step_s = step_s
            log(f"  {lay.label():60s} predicted {lay.predicted_step_s * 1e3:8.2f} ms  measured "
                f"{lay.measured_step_s * 1e3:8.2f} ms")  # fmt: skip
        result["noise"] = noise(prof, len(devs), spreads, target)
        if result["noise"]["warning"]:
            log(result["noise"]["warning"])
        pred = [x.predicted_step_s for x in picks]
        meas = [x.measured_step_s for x in picks]
        best_pred = min(picks, key=lambda x: x.predicted_step_s)
        result["spearman"] = spearman(pred, meas)
        result["top1_ratio"] = best_pred.measured_step_s / min(meas)
        result["layouts"] = [x.record() for x in ranked]
    for line in table_lines(cfg, ranked, top, pruned, result, given):
        log(line)
    return result


def plot(result: dict, path: str) -> None:
    """Left: predicted against measured step time (the layouts measured). Right: each layout's
    predicted time split into compute, each axis's communication, bubble and overhead."""
    import matplotlib  # noqa: PLC0415 - only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    lays = [x for x in result["layouts"] if x["fits"]][:16]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    meas = [x for x in result["layouts"] if x.get("measured_step_s") is not None]
    if meas:
        px = [x["predicted_step_s"] * 1e3 for x in meas]
        my = [x["measured_step_s"] * 1e3 for x in meas]
        ax1.scatter(px, my)
        for x, a, b in zip(meas, px, my, strict=True):
            ax1.annotate(x["mesh"], (a, b), fontsize=7)
        ax1.set_title(f"Spearman {result.get('spearman', float('nan')):.2f}, "
                      f"top-1 ratio {result.get('top1_ratio', float('nan')):.2f}")  # fmt: skip
    ax1.set_xlabel("predicted step (ms)")
    ax1.set_ylabel("measured step (ms)")
    keys = sorted({k for x in lays for k in x["time_split_s"]})
    bottom = np.zeros(len(lays))
    for k in keys:
        vals = np.asarray([x["time_split_s"].get(k, 0.0) * 1e3 for x in lays])
        ax2.bar(range(len(lays)), vals, bottom=bottom, label=k)
        bottom += vals
    ax2.set_xticks(range(len(lays)), [x["mesh"] for x in lays], rotation=60, fontsize=7)
    ax2.set_ylabel("predicted time (ms, before overlap)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"jaxpar tune: {result['recipe']} on {result['devices']} devices "
                 f"({result['hardware']['name']})")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def no_fit_message(cfg: TrainConfig, ranked: list[Layout], prof: hardware.Profile,
                   target: targets.Target | None = None) -> str:  # fmt: skip
    """One line: the smallest memory any layout needed, and what would make it fit."""
    small = min(ranked, key=lambda x: x.memory.get("peak") or math.inf)
    memory = target.memory_bytes if target is not None else prof.memory_bytes
    peak = small.memory.get("peak") or 0
    needs = f"{_gib(peak)} per device" if peak else f"more than {_gib(memory)} ({small.reason})"
    return (
        f"{cfg.name} fits no layout of {math.prod(small.sizes.values())} "
        f"devices on {prof.name}: the smallest is {needs} "
        f"({small.label()}) against {_gib(memory)}; use more devices, "
        f"model.remat=block, a smaller data.global_batch or a smaller model"
    )


def _key(x: Layout):
    return (not x.fits, x.predicted_step_s)


def table_lines(cfg, ranked: list[Layout], top: int, pruned: list[dict], result: dict,
                given=None) -> list[str]:  # fmt: skip
    recipe, overrides = given or (cfg.name, [])
    unit = getattr(cfg.model, "seq_len", 1) * cfg.data.global_batch
    per = "tokens/s" if hasattr(cfg.model, "seq_len") else "samples/s"
    out = ["", f"| # | mesh | settings | predicted ms | {per} | memory/device | fits | remats | "
           "bottleneck | measured ms | reason |",
           "|---:|---|---|---:|---:|---:|---|---:|---|---:|---|"]  # fmt: skip
    for i, x in enumerate(ranked[:top], 1):
        meas = f"{x.measured_step_s * 1e3:.2f}" if x.measured_step_s is not None else ""
        sets = " ".join(f"{k.split('.')[-1]}={v}" for k, v in x.settings.items())
        out.append(
            f"| {i} | {x.mesh} | {sets} | {x.predicted_step_s * 1e3:.2f} | "
            f"{unit / x.predicted_step_s:,.0f} | {x.memory.get('peak', 0) / 2**20:.1f} MiB | "
            f"{'yes' if x.fits else 'no'} | {x.remats} | {x.bottleneck} | {meas} | {x.reason} |"
        )
    if len(ranked) > top:
        out.append(f"({len(ranked) - top} more in --out)")
    out += ["", f"pruned ({len(pruned)}):"]
    seen = set()
    for p in pruned:
        line = (
            f"- {p['mesh']} {' '.join(f'{k}={v}' for k, v in p['settings'].items())}: {p['reason']}"
        )
        if line not in seen:
            seen.add(line)
            out.append(line)
    remat = [x for x in ranked if x.remats]
    out += ["", "## doctor", ""]
    out.append(
        "no layout has involuntary rematerializations"
        if not remat
        else "\n".join(f"- {x.label()}: {x.remats} involuntary rematerialization(s); "
                       f"{x.command(recipe, overrides, 'inspect')} --doctor" for x in remat)
    )  # fmt: skip
    if "spearman" in result:
        out += ["", f"measured {sum(x.measured_step_s is not None for x in ranked)} layouts: "
                f"Spearman {result['spearman']:.3f}, top-1 ratio {result['top1_ratio']:.3f}"]  # fmt: skip
    out += ["", f"winner: {result['winner_command']}"]
    return out
