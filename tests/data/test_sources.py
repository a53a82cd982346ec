"""jaxpar.data.sources: batches are pure functions of (seed, step, split) and tile across processes."""

import dataclasses
import sysconfig

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config import DataConfig, resolve_recipe, validate
from jaxpar.data import sources

SEQ_LEN = 16


@pytest.fixture(scope="module", params=sources.SOURCES)
def source(request):
    path = request.getfixturevalue("tokens_corpus") if request.param == "tokens" else ""
    return sources.make_source(request.param, seq_len=SEQ_LEN, seed=0, path=path)


@pytest.fixture(scope="module")
def text():
    return sources.make_source("stdlib_text", seq_len=SEQ_LEN)


def batch(source, step=0, seed=0, n=8, split="train"):
    return sources.global_batch(source, step=step, global_batch=n, seed=seed, split=split)


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def batches_differ(a, b):
    return any(not np.array_equal(a[k], b[k]) for k in a)


def test_same_seed_and_step_give_identical_batch(source):
    first = batch(source, step=5, seed=3)
    # A restarted process builds a new source object and must get the same rows.
    path = getattr(source, "path", "")
    fresh = sources.make_source(source.name, seq_len=SEQ_LEN, seed=0, path=path)
    assert_batches_equal(first, batch(fresh, step=5, seed=3))


def test_different_step_or_seed_or_split_differs(source):
    base = batch(source, step=5, seed=3)
    assert batches_differ(base, batch(source, step=6, seed=3))
    assert batches_differ(base, batch(source, step=5, seed=4))
    assert batches_differ(base, batch(source, step=5, seed=3, split="eval"))


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_slices_tile_the_global_batch(source, process_count):
    step, n = 7, 8
    full = batch(source, step=step, seed=1, n=n)
    parts = [
        sources.host_batch(
            source, step=step, global_batch=n, seed=1,
            process_index=i, process_count=process_count,
        )
        for i in range(process_count)
    ]  # fmt: skip
    for part in parts:
        assert all(v.shape[0] == n // process_count for v in part.values())
    assert_batches_equal(full, {k: np.concatenate([p[k] for p in parts]) for k in full})


def test_rows_are_consecutive_stream_elements(source):
    # Row r of step s is stream element s*B + r, so the batch size only regroups the stream.
    four_steps_of_2 = [batch(source, step=s, n=2) for s in range(4)]
    one_step_of_8 = batch(source, step=0, n=8)
    joined = {k: np.concatenate([b[k] for b in four_steps_of_2]) for k in one_step_of_8}
    assert_batches_equal(one_step_of_8, joined)


def test_example_shapes_and_dtypes(source):
    b = batch(source, n=4)
    if source.kind == "lm":
        assert b["inputs"].shape == b["targets"].shape == (4, SEQ_LEN)
        assert b["inputs"].dtype == b["targets"].dtype == np.int32
        assert 0 <= b["inputs"].min() and b["inputs"].max() < source.vocab_size
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    else:
        assert b["image"].shape == (4, *source.image_shape) and b["image"].dtype == np.float32
        assert b["label"].shape == (4,) and b["label"].dtype == np.int32
        assert 0.0 <= b["image"].min() and b["image"].max() <= 1.0
        assert 0 <= b["label"].min() and b["label"].max() < source.num_classes
    spec = sources.batch_spec(source, 4)
    assert {k: (v.shape, v.dtype) for k, v in spec.items()} == {
        k: (v.shape, v.dtype) for k, v in b.items()
    }
    line = sources.describe(source)
    assert source.name in line and "\n" not in line


def test_corpus_file_order_is_deterministic(text):
    root = sysconfig.get_paths()["stdlib"]
    listed = sources._stdlib_files(root)
    assert listed == sorted(listed) == sources._stdlib_files(root)
    assert not any("site-packages" in f for f in listed)
    assert text.files == tuple(listed[: len(text.files)])  # a prefix of whole files
    with open(f"{root}/{text.files[0]}", "rb") as f:
        head = f.read()
    assert bytes(text.corpus[: len(head)]) == head


def test_eval_windows_are_disjoint_from_train_bytes(text):
    start = text.eval_start
    assert 0 < start < len(text.corpus)
    for i in range(200):
        off = text.window_offset(i, "train")
        assert 0 <= off and off + SEQ_LEN + 1 <= start
        off = text.window_offset(i, "eval")
        assert start <= off and off + SEQ_LEN + 1 <= len(text.corpus)
    ex = text.example(3, "eval")
    off = text.window_offset(3, "eval")
    window = text.corpus[off : off + SEQ_LEN + 1]
    np.testing.assert_array_equal(ex["inputs"], window[:-1])
    np.testing.assert_array_equal(ex["targets"], window[1:])


def test_digits_split_is_fixed_and_disjoint():
    digits = sources.make_source("digits")
    train, ev = digits.size("train"), digits.size("eval")
    assert train + ev == 1797 and ev == int(1797 * 0.2)
    _, _, rows = sources._digits_arrays()
    assert not set(rows["train"]) & set(rows["eval"])


def test_digits_epochs_cover_the_split_and_reshuffle():
    digits = sources.make_source("digits")
    half = digits.size("train") // 2  # two steps of `half` rows = one epoch (1438 is even)

    def epoch(e):
        steps = [batch(digits, step=2 * e + s, n=half) for s in range(2)]
        return np.concatenate([b["image"] for b in steps]).reshape(2 * half, -1)

    every = np.stack([digits.example(i, "train")["image"].ravel() for i in range(2 * half)])
    first, second = epoch(0), epoch(1)
    key = lambda a: sorted(map(bytes, a))  # noqa: E731 - multiset of images
    assert key(first) == key(second) == key(every)
    assert not np.array_equal(first, second)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sources.make_source("imagenet"), "stdlib_text"),
        (lambda: sources.make_source("stdlib_text", vocab_size=128), "vocab_size=256"),
        (lambda: sources.make_source("stdlib_text", seq_len=10**7), "seq_len <="),
        (lambda: sources.make_source("synthetic_text", seq_len=0), "seq_len"),
        (lambda: sources.make_source("synthetic_text", vocab_size=1), "vocab_size"),
    ],
)
def test_bad_source_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_batch=10, process_count=4), r"global_batch=10 .*process_count=4"),
        (dict(process_index=2, process_count=2), "process_index"),
        (dict(step=-1), "step"),
        (dict(global_batch=0), "global_batch"),
        (dict(seed=-1), "seed"),
        (dict(split="test"), "train"),
    ],
)
def test_bad_batch_arguments_raise(kwargs, match):
    source = sources.make_source("synthetic_text", seq_len=4)
    args = dict(step=0, global_batch=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        sources.host_batch(source, **args)


def test_to_device_assembles_the_global_batch():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    n = 2 * len(devices)
    source = sources.make_source("synthetic_image")
    local = sources.host_batch(
        source, step=2, global_batch=n, seed=0,
        process_index=jax.process_index(), process_count=jax.process_count(),
    )  # fmt: skip
    arrays = sources.to_device(local, {k: sharding for k in local}, global_batch=n)
    expected = batch(source, step=2, n=n)
    for key, value in arrays.items():
        assert value.shape == expected[key].shape and value.sharding == sharding
        np.testing.assert_array_equal(np.asarray(value), expected[key])
    with pytest.raises(ValueError, match="shardings keys"):
        sources.to_device(local, {"image": sharding}, global_batch=n)


@pytest.fixture
def registered():
    """Names registered by a test, removed from the registry afterwards."""
    names = []
    yield names
    for name in names:
        sources.SOURCE_REGISTRY.pop(name, None)


def test_a_registered_source_is_accepted_by_config_and_built_by_make_source(registered):
    seen = []

    @sources.register_source("counting_test")
    def counting(args):
        seen.append(args)
        return sources.SyntheticTextSource(args.seq_len, args.vocab_size, args.seed)

    registered.append("counting_test")
    assert sources.SOURCE_REGISTRY["counting_test"] is counting
    assert sources.SOURCES[-1] == "counting_test"  # derived from the registry, not a copy
    cfg = resolve_recipe("gpt_tiny")
    assert validate(dataclasses.replace(cfg, data=DataConfig(source="counting_test")))
    with pytest.raises(ValueError, match=r"data.source='nowhere' is not allowed.*counting_test"):
        validate(dataclasses.replace(cfg, data=DataConfig(source="nowhere")))
    built = sources.make_source("counting_test", seq_len=8, vocab_size=7, seed=3, path="p")
    assert seen == [sources.SourceArgs(seq_len=8, vocab_size=7, seed=3, path="p")]
    assert built.example(0, "train")["inputs"].shape == (8,) and built.vocab_size == 7
    # a factory that returns no source is caught like a user's MODULE:CALLABLE
    sources.register_source("bare_test", lambda args: object())
    registered.append("bare_test")
    with pytest.raises(ValueError, match="'bare_test' returned object, which lacks"):
        sources.make_source("bare_test")


def test_registry_refuses_clashing_names(registered):
    def make(args):
        return sources.SyntheticImageSource(seed=args.seed)

    with pytest.raises(ValueError, match="already registered"):
        sources.register_source("digits", make)
    for bad in ("my:source", "", " padded"):
        with pytest.raises(ValueError, match="':' means MODULE:CALLABLE"):
            sources.register_source(bad, make)
    sources.register_source("image_test", make)
    registered.append("image_test")
    assert sources.register_source("image_test", make) is make  # the same factory: no change
    assert sources.SOURCE_REGISTRY["digits"] is sources.digits  # the built-in is untouched
