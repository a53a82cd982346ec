"""Typed run configuration: frozen dataclasses, `--set key=value` overrides, stable hashing.

Recipes (train/recipes.py or a user's `module:function`) return a `TrainConfig`. The model
config is any frozen dataclass with a `build(rngs) -> nnx.Module` method; jaxpar does not know
which model it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from jaxpar.contract import ModelConfig, not_hashed  # noqa: F401 - ModelConfig re-exported
from jaxpar.usercode import search_current_directory


@dataclass(frozen=True)
class DataConfig:
    # a registered name (jaxpar.data.sources.SOURCE_REGISTRY), MODULE:CALLABLE, or (from a recipe)
    # a source object/factory
    source: Any = "stdlib_text"
    global_batch: int = 32
    seq_len: int = 64  # lm sources only
    seed: int = 0
    path: str = ""  # tokens: the folder written by `jaxpar data prepare` (docs/data.md)
    dtype: str = ""  # tokens: uint16 | uint32; "" = meta.json's (uint16 for nanoGPT's .bin)


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: decay over train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0  # 0 disables global-norm clipping
    momentum: float = 0.0  # sgd only


@dataclass(frozen=True)
class TrainLoopConfig:
    steps: int = 200
    microbatches: int = 1  # gradient accumulation inside the jitted step
    seed: int = 0  # parameter init and dropout keys (dropout key = fold_in(seed, step))
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 2


@dataclass(frozen=True)
class LogConfig:
    every: int = 1  # metrics.jsonl line every N steps (1 = every step, the contract's default)
    progress: bool = True
    tensorboard: bool = False


@dataclass(frozen=True)
class CkptConfig:
    every: int = 50  # save every N steps (0: never); the final step is always saved
    keep: int = 3  # newest K committed checkpoints are kept
    restore: str = "latest"  # latest | none | STEP
    use_async: bool = True
    force: bool = False  # restore even if the model/optimizer/data config differs
    # local snapshot tier (jaxpar/recovery/local_tier.py): every N steps to node-local RAM; -1 = by state
    # size (1 up to 256 MiB per process), 0 = off
    local_every: int = -1
    local_dir: str = ""  # "" = $JAXPAR_LOCAL_DIR, else /dev/shm/jaxpar-<uid>


@dataclass(frozen=True)
class RunConfig:
    max_wall_s: float = 0.0  # > 0: save and exit cleanly after this many seconds
    # keep each process's compiled programs in RUN_DIR/compiled, so a restart skips compiling
    compile_cache: bool = True
    # a second compiled-program cache shared by runs (e.g. a sweep of one model); "" =
    # $JAXPAR_COMPILE_CACHE_DIR, else none. Used only with compile_cache on.
    compile_cache_dir: str = ""


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline schedule over the `pipeline` mesh axis (used only when that axis is > 1)."""

    schedule: str = "gpipe"  # gpipe | circular | 1f1b | interleaved_1f1b | zero_bubble
    microbatches: int = 4  # m: microbatches per step
    repeats: int = 1  # v: layer groups per stage (circular and interleaved_1f1b)
    # Layers per stage, e.g. "3,3,2,2" (or a tuple from a recipe): one entry per `pipeline` stage,
    # summing to the model's layers; "" splits them evenly. See stage_split().
    stage_layers: str = ""


def stage_split(cfg: PipelineConfig) -> tuple[int, ...]:
    """pipeline.stage_layers as a tuple of ints (() when empty); ValueError names the fix.

    Accepts "3,3,2,2", "[3, 3, 2, 2]" (the form `jaxpar bench pipeline` prints) or a tuple. The
    count and the sum are checked against the mesh and the model where the pipeline is built."""
    raw = cfg.stage_layers
    text = ",".join(map(str, raw)) if isinstance(raw, tuple | list) else str(raw)
    text = text.strip().strip("[]()").replace(" ", "")
    if not text:
        return ()
    try:
        split = tuple(int(x) for x in text.split(","))
    except ValueError:
        split = None
    if split is None or min(split) < 1:
        raise ValueError(
            f"pipeline.stage_layers={raw!r}: give whole layer counts >= 1 per stage, "
            f"e.g. --set pipeline.stage_layers=3,3,2,2 (or leave it empty for an even split)"
        )
    if cfg.schedule in ("circular", "interleaved_1f1b"):
        raise ValueError(
            f"pipeline.stage_layers with pipeline.schedule={cfg.schedule}: uneven stages take "
            f"one contiguous group of layers each; use pipeline.schedule=gpipe, 1f1b or "
            f"zero_bubble, or drop pipeline.stage_layers"
        )
    return split


@dataclass(frozen=True)
class CommConfig:
    """Gradient communication over the data axis (see jaxpar/parallel/compressed.py, diloco.py)."""

    compress: str = "none"  # none | bf16 | int8 (with error feedback)
    diloco_inner_steps: int = 0  # H > 0: DiLoCo / local SGD, replicas sync every H steps
    outer_lr: float = 0.7  # DiLoCo outer optimizer: SGD with Nesterov momentum
    outer_momentum: float = 0.9


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision (see jaxpar/engine/precision.py)."""

    params: str = "float32"  # parameters and optimizer state: always float32
    compute: str = "float32"  # forward and backward: float32 | bfloat16


@dataclass(frozen=True)
class TrainConfig:
    model: Any
    name: str = "run"
    mesh: str = ""  # mesh spec or preset name; "" = all devices on `data`
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # The model contract's user hooks (jaxpar/contract.py, docs/model_contract.md):
    # loss(model, batch, rngs) -> (loss, metrics); None: the data source's built-in task
    loss: Any = None
    # an optax GradientTransformation, or total_steps -> GradientTransformation; None: `optim`
    optimizer: Any = None
    # extra (logical name, mesh axes) rules, after the preset's, for parameters and activations
    rules: tuple = ()
    # parameter rules placed before the preset's (the first rule with free mesh axes wins), e.g.
    # the doctor's "put parameter rule ... first"; a layout choice, so not hashed
    param_rules_first: tuple = ()


USER_HOOKS = ("loss", "optimizer")  # callables a recipe supplies; recorded as MODULE:QUALNAME


def _qualified(v: Any) -> str:
    """MODULE:QUALNAME of a function, class or object (an optax transformation: its update)."""
    if hasattr(v, "update") and not hasattr(v, "__qualname__"):  # optax GradientTransformation
        v = v.update
    t = v if hasattr(v, "__qualname__") else type(v)
    return f"{t.__module__}:{t.__qualname__}"


def to_dict(cfg: Any) -> dict:
    """JSON-ready dict of a (nested) config, with the model's class recorded for reloading."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            d = to_dict(v)
            if f.name == "model":
                d["_class"] = f"{type(v).__module__}:{type(v).__qualname__}"
            v = d
        elif f.name in USER_HOOKS and v is not None:
            v = _qualified(v)
        elif isinstance(v, tuple):
            v = [list(x) if isinstance(x, tuple) else x for x in v]
        elif f.name == "source" and not isinstance(v, str):  # a source or factory from a recipe
            t = v if hasattr(v, "__qualname__") else type(v)
            v = f"{t.__module__}:{t.__qualname__}"
        out[f.name] = v
    return out


def config_hash(
    cfg: TrainConfig,
    sections: tuple[str, ...] = ("model", "data", "optim", "comm", "precision"),
) -> str:
    """Hash of what determines the trained values (model, optimizer, data, gradient
    communication, compute precision), not the layout. train.steps is left out on purpose:
    extending a run to more steps is normal (its learning-rate schedule then follows the new
    length). A model config may name fields that change memory or speed but not the values it
    computes in `NOT_HASHED` (e.g. rematerialisation); they are left out too."""
    blob = json.dumps(hashed_dict(cfg, sections), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def hashed_dict(
    cfg: TrainConfig,
    sections: tuple[str, ...] = ("model", "data", "optim", "comm", "precision"),
) -> dict:
    """What `config_hash` hashes (checkpoints keep it, so a refusal can name what changed)."""
    d = to_dict(cfg)
    d = {k: d[k] for k in sections} | {k: d[k] for k in (*USER_HOOKS, "rules") if d.get(k)}
    for name in not_hashed(cfg.model):
        d["model"].pop(name, None)
    d["train.seed"] = cfg.train.seed
    return d


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Lines `key: old → new` for every leaf that differs between two config dicts."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(absent)"), new.get(key, "(absent)")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: {a!r} → {b!r}" if isinstance(a, str) else f"{name}: {a} → {b}")
    return out


def _convert(text: str, typ: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}={text}: expected a boolean (true/false)")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return _convert(text, args[0], key)
    if typ in (int, float, str):
        try:
            return typ(text)
        except ValueError:
            raise ValueError(f"--set {key}={text}: expected {typ.__name__}") from None
    if origin is tuple:
        return _convert_tuple(text, typ, key)
    if typ is tuple:
        return _convert_tuple(text, tuple[Any, ...], key)
    if typ is Any:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--set {key}={text}: expected a JSON value") from None


def _convert_tuple(text: str, typ: Any, key: str) -> tuple:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list):
        raise ValueError(f"--set {key}={text}: expected a JSON list like [16, 32]")
    args = typing.get_args(typ)
    elem = args[0] if args else Any
    if elem is Any or elem is Ellipsis:
        return tuple(items)
    out = []
    for item in items:
        if elem in (int, float) and (isinstance(item, bool) or not isinstance(item, int | float)):
            raise ValueError(f"--set {key}={text}: elements must be {elem.__name__}")
        if elem is int and isinstance(item, float) and not item.is_integer():
            raise ValueError(f"--set {key}={text}: elements must be int")
        out.append(elem(item) if elem in (int, float, str) else item)
    return tuple(out)


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `key.sub=value` overrides, converting each value to the field's declared type."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: use KEY=VALUE, e.g. --set optim.lr=3e-4")
        cfg = _set_path(cfg, key.strip().split("."), value.strip(), key)
    return cfg


def _set_path(obj: Any, parts: list[str], value: str, key: str, prefix: str = "") -> Any:
    if not dataclasses.is_dataclass(obj):
        raise ValueError(f"--set {key}: {prefix} is a value, not a config section")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    name = parts[0]
    if name not in fields:
        raise ValueError(f"--set {key}: unknown key {name!r}; known here: {sorted(fields)}")
    current = getattr(obj, name)
    if len(parts) == 1 and dataclasses.is_dataclass(current):
        keys = ", ".join(f.name for f in dataclasses.fields(current))
        raise ValueError(
            f"--set {key}: {key} is a config section, not a value; set one of its keys "
            f"({keys}), e.g. --set {key}.{dataclasses.fields(current)[0].name}=VALUE"
        )
    if len(parts) > 1:
        sub = _set_path(current, parts[1:], value, key, f"{prefix}.{name}".lstrip("."))
        return dataclasses.replace(obj, **{name: sub})
    hints = typing.get_type_hints(type(obj), vars(sys.modules[type(obj).__module__]))
    return dataclasses.replace(obj, **{name: _convert(value, hints[name], key)})


def resolve_recipe(name: str) -> TrainConfig:
    """A recipe by name from `jaxpar.train.recipes`, or `module:function` for a user's own.

    A user's module is imported from sys.path; the current directory is searched too, after
    the installed packages (never ahead of them).
    """
    if ":" in name:
        mod_name, fn_name = name.split(":", 1)
    else:
        mod_name, fn_name = "jaxpar.train.recipes", name
    search_current_directory()
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"recipe {name!r}: cannot import {mod_name!r} ({e}); give MODULE:FUNCTION with "
            f"MODULE importable from the current directory or sys.path"
        ) from None
    fn = getattr(mod, fn_name, None)
    if fn is None:
        known = getattr(mod, "RECIPES", None)
        raise ValueError(
            f"unknown recipe {name!r}" + (f"; known: {sorted(known)}" if known else "")
        )
    cfg = fn()
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"recipe {name!r} returned {type(cfg).__name__}, not a TrainConfig")
    return cfg


# ---- ranges: every config value checked in one place -------------------------------------------


@dataclass(frozen=True)
class Range:
    """Allowed values of one numeric key: lo/hi bounds (None: open), whether each is included."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself not allowed
    hi_open: bool = False

    def ok(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        if lo and hi:
            return f"{_num(self.lo)} {'<' if self.lo_open else '<='} x {hi}"
        return lo or hi or "a finite number"


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


POSITIVE, NON_NEGATIVE = Range(0, lo_open=True), Range(0)
AT_LEAST_1 = Range(1)
MAX_STEPS = 2**31 - 1  # step numbers are int32 on the device
STEPS = Range(1, MAX_STEPS)
FRACTION_OPEN = Range(0, 1, hi_open=True)  # [0, 1)

# section.key -> Range, or a tuple of allowed strings. Keys not listed: floats must be finite.
RANGES: dict[str, Range | tuple[str, ...]] = {
    "data.global_batch": AT_LEAST_1,
    "data.seq_len": AT_LEAST_1,
    "data.seed": NON_NEGATIVE,
    "data.dtype": ("", "uint16", "uint32"),
    "optim.name": ("adamw", "sgd"),
    "optim.lr": POSITIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.decay_steps": NON_NEGATIVE,
    "optim.min_lr_ratio": Range(0, 1),
    "optim.weight_decay": NON_NEGATIVE,
    "optim.b1": FRACTION_OPEN,
    "optim.b2": FRACTION_OPEN,
    "optim.clip_norm": NON_NEGATIVE,
    "optim.momentum": FRACTION_OPEN,
    "train.steps": STEPS,
    "train.microbatches": AT_LEAST_1,
    "train.seed": Range(0, 2**63 - 1),  # jax.random.key takes an int64
    "train.eval_every": NON_NEGATIVE,
    "train.eval_batches": AT_LEAST_1,
    "log.every": AT_LEAST_1,
    "ckpt.every": NON_NEGATIVE,
    "ckpt.keep": AT_LEAST_1,
    "ckpt.local_every": Range(-1),  # -1: by state size, 0: off
    "run.max_wall_s": NON_NEGATIVE,
    "pipeline.schedule": ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zero_bubble"),
    "pipeline.microbatches": AT_LEAST_1,
    "pipeline.repeats": AT_LEAST_1,
    "comm.compress": ("none", "bf16", "int8"),
    "comm.diloco_inner_steps": NON_NEGATIVE,
    "comm.outer_lr": POSITIVE,
    "comm.outer_momentum": FRACTION_OPEN,
    "precision.params": ("float32",),
    "precision.compute": ("float32", "bfloat16"),
}


# Where jaxpar's own model configs live (the checkout's models/, installed or served as
# jaxpar.models): only they get the default ranges below; a user's config is checked by its own
# RANGES alone (and every float of it must be finite).
OWN_MODELS = "jaxpar.models"


def own_model_config(model_cfg: Any) -> bool:
    """Whether `model_cfg` is one of jaxpar's own model configs (a class of jaxpar.models)."""
    module = type(model_cfg).__module__
    return module == OWN_MODELS or module.startswith(OWN_MODELS + ".")


def _model_range(name: str, value: Any) -> Range | None:
    """The default range of a field of jaxpar's own model configs (those that declare none in
    `RANGES`): sizes (ints) >= 1 and dropout-like rates in [0, 1)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return AT_LEAST_1
    if isinstance(value, float) and ("dropout" in name or name.endswith("_rate")):
        return FRACTION_OPEN
    return None


def _check(key: str, value: Any, rule: Range | tuple[str, ...] | None) -> None:
    if isinstance(rule, tuple):
        if value not in rule:
            raise ValueError(f"{key}={value!r} is not allowed: use one of {list(rule)}")
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if rule is None:
        rule = Range()
    if not rule.ok(value):
        raise ValueError(
            f"{key}={value!r} is out of range: allowed {rule.describe()} (--set {key}=VALUE)"
        )


# Kernel filesystems: no folder of a run can live there (/dev/shm, a RAM disk, can).
_KERNEL_DIRS = ("/proc", "/sys", "/dev")
_RAM_DIR = "/dev/shm"


def _check_dir(key: str, path: str) -> None:
    """A folder setting ("" = its default) must name a folder that can be one: not under /proc,
    /sys or /dev (but /dev/shm), not a file, nor below one. Checked before a run writes
    anything; nothing is created."""
    if not path:
        return
    real = os.path.realpath(path)
    within = [d for d in (*_KERNEL_DIRS, _RAM_DIR) if real == d or real.startswith(d + os.sep)]
    if within and within[-1] != _RAM_DIR:
        raise ValueError(
            f"{key}={path} is under {within[0]}, a kernel filesystem; use a folder on a disk or "
            f"in {_RAM_DIR} (--set {key}=DIR, or leave it empty for the default)"
        )
    probe = real
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"{key}={path}: {probe} is a file, not a folder; give a folder path")


def _check_seq_len(cfg: TrainConfig) -> None:
    """A language model trains on windows of its own `seq_len`: data.seq_len must agree (it
    used to be recorded in config.json and ignored). Both are set together, never guessed: the
    model's size and memory follow from it."""
    model_len = getattr(cfg.model, "seq_len", None)
    if isinstance(model_len, int) and model_len != cfg.data.seq_len:
        n = cfg.data.seq_len
        raise ValueError(
            f"data.seq_len={n} but model.seq_len={model_len}: the model's context is the window "
            f"length; set both (--set data.seq_len={n} --set model.seq_len={n}) or neither"
        )


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every value of `cfg` against its allowed range (ValueError naming the key and the
    range); returns `cfg`. Called before a run writes anything."""
    if not dataclasses.is_dataclass(cfg.model):
        raise ValueError(f"model={cfg.model!r}: the model config must be a dataclass")
    # a model config's own RANGES; jaxpar's default ranges for jaxpar's own configs only (a
    # user's field named like one of theirs means something else); every float finite
    own = getattr(type(cfg.model), "RANGES", {})
    defaults = own_model_config(cfg.model)
    for f in dataclasses.fields(cfg.model):
        value = getattr(cfg.model, f.name)
        key = f"model.{f.name}"
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            rule = own.get(f.name) or (_model_range(f.name, item) if defaults else None)
            _check(key, item, rule)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if f.name == "model" or not dataclasses.is_dataclass(section):
            continue
        for g in dataclasses.fields(section):
            key = f"{f.name}.{g.name}"
            _check(key, getattr(section, g.name), RANGES.get(key))
    for hook in USER_HOOKS:
        value = getattr(cfg, hook, None)
        transformation = hook == "optimizer" and hasattr(value, "init") and hasattr(value, "update")
        if value is not None and not callable(value) and not transformation:
            raise ValueError(
                f"{hook}={value!r}: a recipe sets it to a Python callable; it cannot be set "
                f"with --set"
            )
    for rule in (*cfg.rules, *cfg.param_rules_first):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(
                f'rules: {rule!r} is not a (logical name, mesh axes) pair, e.g. [["mlp", "tensor"]]'
            )
    for key, path in (("ckpt.local_dir", cfg.ckpt.local_dir),
                      ("run.compile_cache_dir", cfg.run.compile_cache_dir)):  # fmt: skip
        _check_dir(key, path)
    _check_seq_len(cfg)
    stage_split(cfg.pipeline)
    restore = cfg.ckpt.restore
    if restore not in ("latest", "none") and not restore.isdigit():
        raise ValueError(f"ckpt.restore={restore!r}: use latest, none or a step number")
    from jaxpar.data import sources  # the data package owns the registry of source names

    source = cfg.data.source
    if isinstance(source, str) and ":" not in source and source not in sources.SOURCE_REGISTRY:
        raise ValueError(
            f"data.source={source!r} is not allowed: use one of {sources.source_names()} or "
            "MODULE:CALLABLE"
        )
    return cfg


def warnings_for(cfg: TrainConfig) -> list[str]:
    """Settings that are valid but lose work silently; printed at start."""
    out = []
    if cfg.ckpt.every == 0:
        out.append(
            "ckpt.every=0: no checkpoint will be written, so a failure or a stop loses the whole "
            "run (set ckpt.every=N to save every N steps)"
        )
    return out
