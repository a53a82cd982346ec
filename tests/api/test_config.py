"""`--set key=value` overrides convert to each field's declared type; config_hash ignores layout."""

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from jaxpar.config import (
    TrainConfig,
    apply_overrides,
    config_hash,
    resolve_recipe,
    to_dict,
    validate,
)
from jaxpar.data import sources
from jaxpar.models.cnn import CNNConfig
from jaxpar.models.gpt import GPTConfig


@pytest.fixture
def gpt():
    return resolve_recipe("gpt_tiny")


def test_scalar_types_are_converted(gpt):
    cfg = apply_overrides(
        gpt,
        [
            "train.steps=7",
            "optim.lr=3e-4",
            "optim.weight_decay=0",  # an int literal for a float field
            "log.progress=false",
            "log.tensorboard=yes",
            "optim.name=sgd",
            "name=my run",
        ],
    )
    assert cfg.train.steps == 7 and type(cfg.train.steps) is int
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.optim.weight_decay == 0.0 and type(cfg.optim.weight_decay) is float
    assert cfg.log.progress is False and cfg.log.tensorboard is True
    assert cfg.optim.name == "sgd" and cfg.name == "my run"
    # Untouched fields keep the recipe's values; the original is not modified (frozen).
    assert cfg.optim.b1 == gpt.optim.b1 and cfg.data == gpt.data
    assert gpt.train.steps != 7 and gpt.log.progress is True


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("On", True), ("0", False),
                                         ("False", False), ("no", False), ("off", False)])  # fmt: skip
def test_bool_spellings(gpt, text, value):
    assert apply_overrides(gpt, [f"log.progress={text}"]).log.progress is value


def test_nested_model_fields_use_the_model_dataclass_types(gpt):
    cfg = apply_overrides(gpt, ["model.d_model=64", "model.dropout=0.1", "model.n_layers=2"])
    assert isinstance(cfg.model, GPTConfig)
    assert (cfg.model.d_model, cfg.model.dropout, cfg.model.n_layers) == (64, 0.1, 2)
    assert type(cfg.model.d_model) is int and type(cfg.model.dropout) is float
    assert cfg.model.vocab_size == gpt.model.vocab_size


def test_tuple_fields(gpt):
    cnn = apply_overrides(resolve_recipe("digits_cnn"), ["model.channels=[16, 32, 64]"])
    assert isinstance(cnn.model, CNNConfig) and cnn.model.channels == (16, 32, 64)
    assert apply_overrides(cnn, ["model.channels=[8]"]).model.channels == (8,)


def test_value_may_contain_equals_and_later_overrides_win(gpt):
    cfg = apply_overrides(gpt, ["mesh=data=2,tensor=4", "train.steps=3", "train.steps=4"])
    assert cfg.mesh == "data=2,tensor=4" and cfg.train.steps == 4
    assert apply_overrides(gpt, [" train.steps = 9 "]).train.steps == 9
    assert apply_overrides(gpt, []) == gpt


@dataclass(frozen=True)
class _Inner:
    width: int = 1
    scale: float | None = None
    sizes: tuple[int, ...] = (1, 2)


@dataclass(frozen=True)
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    label: str = "x"


def test_optional_and_deeper_nesting_on_any_dataclass():
    cfg = apply_overrides(_Outer(), ["inner.scale=0.5", "inner.width=3", "inner.sizes=[4]"])
    assert cfg == _Outer(_Inner(width=3, scale=0.5, sizes=(4,)))
    assert type(cfg.inner.scale) is float
    assert apply_overrides(cfg, ["inner.scale=none"]).inner.scale is None
    assert apply_overrides(cfg, ["inner.scale=null"]).inner.scale is None
    with pytest.raises(ValueError, match=r"inner.scale=big: expected float"):
        apply_overrides(cfg, ["inner.scale=big"])
    with pytest.raises(ValueError, match=r"unknown key 'depth'; known here: \['scale', 'sizes'"):
        apply_overrides(cfg, ["inner.depth=2"])


def test_path_through_a_value_names_the_value(gpt):
    with pytest.raises(ValueError, match=r"optim\.lr is .*not a config section"):
        apply_overrides(gpt, ["optim.lr.x=1"])


def test_path_through_a_value_is_an_error(gpt):
    with pytest.raises(ValueError, match=r"--set optim.lr.x: .*not a config section"):
        apply_overrides(gpt, ["optim.lr.x=1"])


# ---- config_hash and to_dict -------------------------------------------------------------------


def _replace(cfg: TrainConfig, **sections) -> TrainConfig:
    """_replace(cfg, optim={"lr": 1.0}) replaces fields inside sections; plain values as is."""
    changes = {
        k: dataclasses.replace(getattr(cfg, k), **v) if isinstance(v, dict) else v
        for k, v in sections.items()
    }
    return dataclasses.replace(cfg, **changes)


def test_config_hash_is_stable_and_short(gpt):
    h = config_hash(gpt)
    assert h == config_hash(resolve_recipe("gpt_tiny"))  # a fresh, equal config
    assert len(h) == 16 and int(h, 16) >= 0


@pytest.mark.parametrize(
    "changes",
    [
        {"mesh": "dp2_tp4"},
        {"name": "other"},
        {"log": {"progress": False, "every": 10}},
        {"train": {"microbatches": 4, "eval_every": 7}},
        {"ckpt": {"every": 5}},
    ],
    ids=lambda c: ",".join(c),
)
def test_config_hash_ignores_layout_and_logging(gpt, changes):
    assert config_hash(_replace(gpt, **changes)) == config_hash(gpt)


@pytest.mark.parametrize(
    "changes",
    [
        {"model": {"d_model": 64}},
        {"model": {"dropout": 0.1}},
        {"optim": {"lr": 1e-4}},
        {"optim": {"name": "sgd"}},
        {"data": {"seed": 1}},
        {"data": {"global_batch": 64}},
        {"train": {"seed": 1}},
    ],
    ids=lambda c: ",".join(f"{k}.{next(iter(v))}" for k, v in c.items()),
)
def test_config_hash_changes_with_what_is_trained(gpt, changes):
    assert config_hash(_replace(gpt, **changes)) != config_hash(gpt)


@dataclass(frozen=True)
class _OtherGPT(GPTConfig):
    """Same fields as GPTConfig, another model."""


def test_config_hash_tells_model_classes_apart(gpt):
    other = dataclasses.replace(gpt, model=_OtherGPT(**dataclasses.asdict(gpt.model)))
    assert config_hash(other) != config_hash(gpt)
    assert config_hash(resolve_recipe("digits_mlp")) != config_hash(resolve_recipe("digits_cnn"))


def test_to_dict_is_json_and_records_the_model_class(gpt):
    d = to_dict(gpt)
    assert json.loads(json.dumps(d)) == d
    assert d["model"]["_class"] == "jaxpar.models.gpt:GPTConfig"
    assert d["optim"]["lr"] == gpt.optim.lr and d["mesh"] == gpt.mesh
    assert to_dict(resolve_recipe("digits_cnn"))["model"]["channels"] == [32, 64]


def test_data_source_names_are_checked_against_the_registry(gpt):
    for name in sources.SOURCES:
        validate(apply_overrides(gpt, [f"data.source={name}"]))
    validate(apply_overrides(gpt, ["data.source=my_module:make"]))  # imported when built
    with pytest.raises(ValueError, match=r"data.source='imagenet' is not allowed: use one of \("):
        validate(apply_overrides(gpt, ["data.source=imagenet"]))
    assert sources.SOURCES == tuple(sources.SOURCE_REGISTRY)
