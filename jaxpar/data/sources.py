"""Deterministic input: the batch for a step is a pure function of (source, seed, step, split).

The `Source` protocol, the registry (`SOURCE_REGISTRY`, `register_source`, `SOURCES`), the
built-in sources, `make_source` and `host_batch` (each process builds only its own rows). Design:
docs/data.md ("Writing a data source", "Built-in sources", "Multi-host reading"); a new built-in:
docs/design.md, "Adding a data source".
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grain
import jax
import numpy as np

from jaxpar.data import tokens
from jaxpar.data.codec import Codec
from jaxpar.data.spec import (  # noqa: F401 - lm_spec, SourceArgs: part of this API
    SPLITS,
    SourceArgs,
    check_seq_len,
    lm_spec,
    split_id,
)
from jaxpar.usercode import search_current_directory

KINDS = ("lm", "classify")

_CORPUS_CAP_BYTES = 8_000_000  # whole files up to this size: loads in well under a second
_TEXT_EVAL_FRACTION = 0.05
_DIGITS_EVAL_FRACTION = 0.2
# The digits split never depends on the run's seed, so eval losses of different runs compare.
_DIGITS_SPLIT_SEED = 0
_IMAGE_SHAPE = (8, 8, 1)
_NUM_CLASSES = 10
_BYTE_VOCAB = Codec().vocab_size  # byte-level text: one id per byte
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


class Source(Protocol):
    """A random-access example source (the data-source protocol).

    Required: `name`, `kind` ("lm" or "classify"), `example(index, split)` and `size(split)`.
    `lm` sources also carry `seq_len` and `vocab_size`; `classify` sources carry `image_shape`
    and `num_classes`. Optional: `spec()` (the example's shapes and dtypes without reading one;
    default: read example 0), `describe()` (one line), `vocab_fixed` (True when the data fixes
    the vocabulary, e.g. a trained tokenizer: the model's `vocab_size` must then equal it), and
    how its ids decode back into text (jaxpar/data/codec.py): `codec()` (an object with
    `encode`, `decode` and `vocab_size`, e.g. `Codec()` for UTF-8 bytes) or `tokenizer_file`
    (a Hugging Face tokenizer.json).

    The contract every source keeps: `example` is a pure function of (source, index, split), so
    the batch of step s is a pure function of (source, seed, step) on any process count.
    """

    name: str
    kind: str  # "lm" or "classify"

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        """The example at `index` of `split`; a pure function of (source, index, split)."""
        ...

    def size(self, split: str) -> int | None:
        """Examples in `split`, or None when examples are keyed (any index >= 0 is valid)."""
        ...


SourceFactory = Callable[[SourceArgs], Source]

# name -> factory: what `data.source=NAME` builds. Insertion order is `SOURCES`' order.
SOURCE_REGISTRY: dict[str, SourceFactory] = {}


def register_source(name: str, factory: SourceFactory | None = None) -> Any:
    """Make `factory` (called with one `SourceArgs`, returns a `Source`) the source `name`.

    `register_source("name", factory)`, or as a decorator: `@register_source("name")`. The name
    is then accepted by `data.source` (config validation asks this registry) and built by
    `make_source`. A name cannot contain ":" (that is MODULE:CALLABLE) and cannot be taken twice
    by different factories (ValueError); registering the same factory again changes nothing."""
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ValueError(
            f"data source name {name!r}: use a non-empty name without ':' or surrounding spaces "
            "(':' means MODULE:CALLABLE)"
        )

    def add(f: SourceFactory) -> SourceFactory:
        if not callable(f):
            raise ValueError(f"data source {name!r}: {f!r} is not a callable taking SourceArgs")
        have = SOURCE_REGISTRY.get(name)
        if have is not None and have is not f:
            raise ValueError(
                f"data source {name!r} is already registered ({source_label(have)}); pick "
                "another name"
            )
        SOURCE_REGISTRY[name] = f
        return f

    return add if factory is None else add(factory)


def source_names() -> tuple[str, ...]:
    """The registered source names, in registration order (what `SOURCES` is)."""
    return tuple(SOURCE_REGISTRY)


def __getattr__(name: str) -> Any:
    # `SOURCES` is derived from the registry on every access, so it includes later registrations.
    if name == "SOURCES":
        return source_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _classify_spec(image_shape: tuple[int, ...]) -> dict[str, jax.ShapeDtypeStruct]:
    return {
        "image": jax.ShapeDtypeStruct(image_shape, np.float32),
        "label": jax.ShapeDtypeStruct((), np.int32),
    }


def _lm_example(window: np.ndarray) -> dict[str, np.ndarray]:
    window = window.astype(np.int32)
    return {"inputs": window[:-1], "targets": window[1:]}


# ---------------------------------------------------------------------------------------------
# stdlib_text


def _stdlib_files(root: str) -> list[str]:
    """Sorted posix relative paths of the stdlib's .py files, site-packages excluded."""
    paths = []
    for directory, subdirs, files in os.walk(root):
        # Third-party packages vary by machine; the stdlib itself is fixed by the Python version.
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        rel = os.path.relpath(directory, root)
        for name in files:
            if name.endswith(".py"):
                paths.append(os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/"))
    return sorted(paths)


@functools.cache
def _stdlib_corpus() -> tuple[np.ndarray, tuple[str, ...]]:
    """The byte corpus and the files in it; loaded once per process."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    used: list[str] = []
    total = 0
    for rel in _stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\n"
        if total + len(data) > _CORPUS_CAP_BYTES:
            break  # stop at a file boundary so the corpus is a prefix of whole files
        chunks.append(data)
        used.append(rel)
        total += len(data)
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)  # read-only: safe to share views
    return corpus, tuple(used)


@dataclass(frozen=True, eq=False)
class TextCorpusSource:
    """Byte-level language modelling over a fixed corpus; windows at keyed random offsets."""

    name: str
    seq_len: int
    vocab_size: int
    seed: int
    corpus: np.ndarray = field(repr=False)
    files: tuple[str, ...] = field(repr=False)
    kind: str = "lm"

    @property
    def eval_start(self) -> int:
        """First byte of the eval split; bytes before it are train."""
        return len(self.corpus) - int(len(self.corpus) * _TEXT_EVAL_FRACTION)

    def split_bytes(self, split: str) -> tuple[int, int]:
        """[start, stop) byte range of `split`."""
        if split_id(split) == 0:
            return 0, self.eval_start
        return self.eval_start, len(self.corpus)

    def size(self, split: str) -> int | None:
        split_id(split)
        return None

    def spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        return lm_spec(self.seq_len)

    def window_offset(self, index: int, split: str) -> int:
        """Start of the (seq_len + 1)-byte window of example `index`; depends on nothing else."""
        lo, hi = self.split_bytes(split)
        rng = np.random.default_rng([self.seed, split_id(split), index])
        return int(rng.integers(lo, hi - self.seq_len))  # window ends at or before `hi`

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        off = self.window_offset(index, split)
        return _lm_example(self.corpus[off : off + self.seq_len + 1])

    def codec(self) -> Codec:
        """Its ids are the corpus's bytes."""
        return Codec()

    def describe(self) -> str:
        train, ev = (hi - lo for lo, hi in map(self.split_bytes, SPLITS))
        return (
            f"{self.name}: {len(self.corpus):,} bytes of Python stdlib source "
            f"({len(self.files)} files), lm seq_len={self.seq_len} vocab={self.vocab_size}; "
            f"train {train:,} bytes, eval {ev:,} bytes"
        )


@register_source("stdlib_text")
def stdlib_text(args: SourceArgs) -> TextCorpusSource:
    """Byte-level text of the Python standard library's source."""
    check_seq_len(args.seq_len)
    if args.vocab_size < _BYTE_VOCAB:
        raise ValueError(
            f"stdlib_text is byte-level text: vocab_size must be >= {_BYTE_VOCAB}, got "
            f"{args.vocab_size}; set vocab_size={_BYTE_VOCAB}"
        )
    corpus, files = _stdlib_corpus()
    source = TextCorpusSource(
        "stdlib_text", args.seq_len, args.vocab_size, args.seed, corpus=corpus, files=files
    )
    smallest = min(hi - lo for lo, hi in map(source.split_bytes, SPLITS))
    if args.seq_len + 1 > smallest:
        raise ValueError(
            f"seq_len={args.seq_len} does not fit the stdlib_text eval split ({smallest} bytes); "
            f"use seq_len <= {smallest - 1}"
        )
    return source


# ---------------------------------------------------------------------------------------------
# tokens: its own module (jaxpar/data/tokens.py)

register_source("tokens", tokens.open_source)


# ---------------------------------------------------------------------------------------------
# digits


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Images [N, 8, 8, 1] in [0, 1], labels [N], and the fixed per-split row indices."""
    from sklearn.datasets import load_digits  # slow import; only this source needs it

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels))
    n_eval = int(len(labels) * _DIGITS_EVAL_FRACTION)
    splits = {"train": np.sort(order[n_eval:]), "eval": np.sort(order[:n_eval])}
    for a in (images, labels, *splits.values()):
        a.flags.writeable = False  # examples are views into the cache
    return images, labels, splits


@dataclass(frozen=True, eq=False)
class DigitsSource:
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), bundled with it."""

    name: str = "digits"
    kind: str = "classify"
    image_shape: tuple[int, ...] = _IMAGE_SHAPE
    num_classes: int = _NUM_CLASSES

    def size(self, split: str) -> int | None:
        return len(_digits_arrays()[2][SPLITS[split_id(split)]])

    def spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        return _classify_spec(self.image_shape)

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        images, labels, splits = _digits_arrays()
        rows = splits[SPLITS[split_id(split)]]
        if not 0 <= index < len(rows):
            raise IndexError(f"digits {split} index {index} out of range [0, {len(rows)})")
        row = rows[index]
        return {"image": images[row], "label": np.asarray(labels[row])}

    def describe(self) -> str:
        return (
            f"{self.name}: {len(_digits_arrays()[1]):,} examples of {self.image_shape} images, "
            f"{self.num_classes} classes; train {self.size('train'):,}, "
            f"eval {self.size('eval'):,} examples"
        )


@register_source("digits")
def digits(args: SourceArgs) -> DigitsSource:
    """scikit-learn's digits; takes none of the arguments."""
    _digits_arrays()  # load now: a missing scikit-learn fails here, not at step 0
    return DigitsSource()


# ---------------------------------------------------------------------------------------------
# synthetic


@dataclass(frozen=True, eq=False)
class SyntheticTextSource:
    """Uniform random tokens keyed by (seed, split, index); no I/O, nothing to learn."""

    seq_len: int
    vocab_size: int
    seed: int
    name: str = "synthetic_text"
    kind: str = "lm"

    def size(self, split: str) -> int | None:
        split_id(split)
        return None

    def spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        return lm_spec(self.seq_len)

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, split_id(split), index])
        return _lm_example(rng.integers(0, self.vocab_size, self.seq_len + 1))

    def codec(self) -> Codec:
        """Random ids carry no text; shown as bytes (ids >= 256 are never sampled then)."""
        return Codec()

    def describe(self) -> str:
        return (
            f"{self.name}: unbounded random tokens, lm seq_len={self.seq_len} "
            f"vocab={self.vocab_size}, seed {self.seed}; train and eval keyed separately"
        )


@register_source("synthetic_text")
def synthetic_text(args: SourceArgs) -> SyntheticTextSource:
    check_seq_len(args.seq_len)
    if args.vocab_size < 2:
        raise ValueError(f"synthetic_text needs vocab_size >= 2, got {args.vocab_size}")
    return SyntheticTextSource(seq_len=args.seq_len, vocab_size=args.vocab_size, seed=args.seed)


@dataclass(frozen=True, eq=False)
class SyntheticImageSource:
    """Random images keyed by (seed, split, index): a per-class template plus noise.

    The template makes the task learnable, so a benchmark's loss still moves.
    """

    seed: int
    name: str = "synthetic_image"
    kind: str = "classify"
    image_shape: tuple[int, ...] = _IMAGE_SHAPE
    num_classes: int = _NUM_CLASSES

    @functools.cached_property
    def _templates(self) -> np.ndarray:
        # The split id slot holds len(SPLITS), a key no example uses.
        rng = np.random.default_rng([self.seed, len(SPLITS)])
        return rng.random((self.num_classes, *self.image_shape), dtype=np.float32)

    def size(self, split: str) -> int | None:
        split_id(split)
        return None

    def spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        return _classify_spec(self.image_shape)

    def example(self, index: int, split: str) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, split_id(split), index])
        label = rng.integers(0, self.num_classes)
        noise = rng.random(self.image_shape, dtype=np.float32)
        image = 0.5 * self._templates[label] + 0.5 * noise
        return {"image": image, "label": np.asarray(label, np.int32)}

    def describe(self) -> str:
        return (
            f"{self.name}: unbounded random {self.image_shape} images, {self.num_classes} "
            f"classes, seed {self.seed}; train and eval keyed separately"
        )


@register_source("synthetic_image")
def synthetic_image(args: SourceArgs) -> SyntheticImageSource:
    return SyntheticImageSource(seed=args.seed)


# ---------------------------------------------------------------------------------------------
# public API


def make_source(
    name: Any,
    *,
    seq_len: int = 64,
    vocab_size: int = 256,
    seed: int = 0,
    path: str = "",
    dtype: str = "",
) -> Source:
    """Build a source from a registered name (`SOURCES`), a `module:callable` name, a source
    object or a factory callable (called with one `SourceArgs`).

    `seed` fixes the source's own randomness (synthetic contents, text window offsets); the order
    in which examples are visited is `host_batch`'s seed. `seq_len`/`vocab_size` apply to `lm`
    sources only; `path`/`dtype` to `tokens` (and to user factories that want them).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    args = SourceArgs(seq_len=seq_len, vocab_size=vocab_size, seed=seed, path=path, dtype=dtype)
    if not isinstance(name, str):
        return check_source(_from_object(name, args), source_label(name))
    if ":" in name:
        return check_source(_from_object(_import(name), args), name)
    factory = SOURCE_REGISTRY.get(name)
    if factory is None:
        raise ValueError(
            f"unknown data source {name!r}; use one of {source_names()} or MODULE:CALLABLE for "
            "your own (see: jaxpar docs data)"
        )
    return check_source(factory(args), name)


def source_label(source: Any) -> str:
    """A JSON-ready name for `data.source` (a string as is; an object or factory by its path)."""
    if isinstance(source, str):
        return source
    t = source if hasattr(source, "__qualname__") else type(source)  # a factory, else an object
    return f"{t.__module__}:{t.__qualname__}"


def _import(name: str) -> Any:
    mod_name, _, attr = name.partition(":")
    search_current_directory()  # a user's module in the current directory, like recipes
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"data source {name!r}: cannot import {mod_name!r} ({e}); put the module on sys.path "
            "(the current directory counts)"
        ) from None
    obj = getattr(mod, attr, None) if attr else None
    if obj is None:
        raise ValueError(f"data source {name!r}: module {mod_name!r} has no attribute {attr!r}")
    return obj


def _from_object(obj: Any, args: SourceArgs) -> Any:
    """A source object as is; a factory (class or function) called with `args`."""
    if hasattr(obj, "example") and not isinstance(obj, type):
        return obj
    if callable(obj):
        return obj(args)
    raise ValueError(f"data source {obj!r} is neither a source nor a callable returning one")


def check_source(source: Any, label: str) -> Source:
    """Check that `source` follows the protocol; ValueError naming what is missing."""
    missing = [a for a in ("name", "kind", "example", "size") if not hasattr(source, a)]
    if missing:
        raise ValueError(
            f"data source {label!r} returned {type(source).__name__}, which lacks {missing}; a "
            "source needs name, kind, example(index, split) and size(split) (jaxpar docs data)"
        )
    if source.kind not in KINDS:
        raise ValueError(f"data source {label!r}: kind={source.kind!r}; use one of {KINDS}")
    need = ("seq_len", "vocab_size") if source.kind == "lm" else ("image_shape", "num_classes")
    lacking = [a for a in need if not hasattr(source, a)]
    if lacking:
        raise ValueError(f"data source {label!r}: a {source.kind} source needs {lacking}")
    return source


def describe(source: Source) -> str:
    """One line: name, size in bytes or examples, split sizes."""
    own = getattr(source, "describe", None)
    if callable(own):
        return own()
    sizes = ", ".join(f"{s} {'unbounded' if (n := source.size(s)) is None else n}" for s in SPLITS)
    return f"{source.name}: {source.kind} source; {sizes}"


def _shuffle_seed(seed: int, split: str) -> int:
    # Grain seeds epoch e with (seed + e): hash first so that seed 1 is not seed 0's epoch 2.
    return int(np.random.SeedSequence([seed, split_id(split)]).generate_state(1)[0])


def _stream_key(seed: int, position: int) -> int:
    """Example index of stream `position` for a keyed source: distinct per (seed, position)."""
    return int(np.random.SeedSequence([seed, position]).generate_state(1, np.uint64)[0] >> 1)


def _stream(source: Source, split: str, seed: int) -> grain.MapDataset:
    """The infinite random-access example stream of (source, split, seed)."""
    n = source.size(split)
    if n is None:
        indices = grain.MapDataset.range(sys.maxsize).map(lambda p: _stream_key(seed, p))
    else:
        # Each epoch is a fresh permutation (grain reseeds shuffle per repeat epoch).
        indices = grain.MapDataset.range(n).shuffle(seed=_shuffle_seed(seed, split)).repeat()
    return indices.map(lambda i: source.example(int(i), split))


def _check_batch_args(step: int, global_batch: int, seed: int, index: int, count: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if count < 1 or not 0 <= index < count:
        raise ValueError(
            f"need 0 <= process_index < process_count, got process_index={index}, "
            f"process_count={count}"
        )
    if global_batch % count:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by process_count={count}; "
            f"use a multiple of {count}"
        )


def host_batch(
    source: Source,
    *,
    step: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    split: str = "train",
) -> dict[str, np.ndarray]:
    """This process's rows of the global batch for `step`.

    Returns rows [process_index * B/P, (process_index + 1) * B/P) of the global batch (B =
    global_batch, P = process_count), each a leading-dim-stacked array. Row r of step s is element
    s * B + r of the (source, split, seed) stream, so the result is identical for any P.
    """
    _check_batch_args(step, global_batch, seed, process_index, process_count)
    rows = global_batch // process_count
    start = step * global_batch + process_index * rows
    stream = _stream(source, split, seed)
    examples = [stream[p] for p in range(start, start + rows)]
    return {key: np.stack([e[key] for e in examples]) for key in examples[0]}


def global_batch(
    source: Source, *, step: int, global_batch: int, seed: int, split: str = "train"
) -> dict[str, np.ndarray]:
    """All rows of the batch for `step` (the reference that process slices must tile)."""
    return host_batch(source, step=step, global_batch=global_batch, seed=seed, split=split)


def batch_spec(source: Source, global_batch: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shapes and dtypes of a batch, without building one (for tracing/compiling).

    From the source's `spec()` where it has one, else from its example 0."""
    own = getattr(source, "spec", None)
    one = own() if callable(own) else source.example(0, "train")
    return {
        k: jax.ShapeDtypeStruct((global_batch, *np.shape(v)), np.dtype(v.dtype))
        for k, v in one.items()
    }


def to_device(
    local: dict[str, np.ndarray],
    shardings: dict[str, jax.sharding.Sharding],
    global_batch: int,
) -> dict[str, jax.Array]:
    """Assemble global arrays from this process's rows (`host_batch` output).

    The batch dimension must be sharded so that process i's devices hold rows
    [i * B/P, (i + 1) * B/P) — true for a mesh whose devices are ordered by process.
    """
    if set(local) != set(shardings):
        raise ValueError(
            f"shardings keys {sorted(shardings)} must match batch keys {sorted(local)}; "
            "give one sharding per batch entry"
        )
    out = {}
    for key, rows in local.items():
        if rows.shape[0] > global_batch:
            raise ValueError(
                f"{key!r} has {rows.shape[0]} local rows but global_batch={global_batch}; "
                "pass the global batch size, not the per-process one"
            )
        shape = (global_batch, *rows.shape[1:])
        out[key] = jax.make_array_from_process_local_data(shardings[key], rows, shape)
    return out
