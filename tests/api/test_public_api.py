"""The `jaxpar` package's public surface: lazy imports, every exported name resolves."""

import subprocess
import sys

import jaxpar


def test_import_jaxpar_and_supervisor_do_not_import_jax():
    code = (
        "import sys, jaxpar, jaxpar.supervisor; "
        "print(jaxpar.__version__); assert 'jax' not in sys.modules, 'jax imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == jaxpar.__version__


def test_flax_does_not_import_ipython_in_a_jaxpar_process_but_users_still_can():
    """flax.nnx and treescope probe for IPython by importing it (about a second where Jupyter is
    installed); in a process that has not loaded IPython the answer is "no" without the import."""
    code = (
        "import sys, jaxpar, flax.nnx, treescope; from flax.nnx import reprlib, visualization; "
        "assert 'IPython' not in sys.modules, 'IPython imported'; "
        "assert visualization.in_ipython is False; "
        "import IPython; from IPython import get_ipython; assert get_ipython() is None; "
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_every_exported_name_resolves():
    for name in jaxpar.__all__:
        assert getattr(jaxpar, name) is not None, name
    assert sorted(dir(jaxpar)) == sorted(jaxpar.__all__)


def test_unknown_attribute_is_an_attribute_error():
    try:
        jaxpar.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def _loss(model, batch, rngs):
    return 0.0, {}


def test_model_contract_is_typed_and_checked():
    import dataclasses

    import pytest

    from jaxpar import contract
    from jaxpar.models.gpt import GPTConfig
    from jaxpar.models.mlp import MLPConfig

    gpt, mlp = GPTConfig(), MLPConfig()
    assert isinstance(gpt, contract.ModelConfig) and isinstance(gpt, contract.FlopsPerToken)
    assert contract.not_hashed(gpt) == ("remat", "attention") and contract.not_hashed(mlp) == ()
    assert contract.flops_per_step(mlp, "classification", 4, 1) == 4 * mlp.flops_per_example()
    assert contract.flops_per_step(object(), "lm", 4, 8) is None

    @dataclasses.dataclass(frozen=True)
    class NoBuild:
        width: int = 3

    with pytest.raises(ValueError, match=r"has no build\(rngs\) method"):
        contract.check_model_config(NoBuild())


def test_user_hooks_are_recorded_and_hashed():
    import optax

    from jaxpar.config import TrainConfig, config_hash, to_dict
    from jaxpar.models.mlp import MLPConfig

    base = TrainConfig(model=MLPConfig())
    hooked = TrainConfig(model=MLPConfig(), loss=_loss, optimizer=optax.sgd(0.1),
                         rules=(("hidden", "tensor"),))  # fmt: skip
    d = to_dict(hooked)
    assert d["loss"] == f"{__name__}:_loss"
    assert d["optimizer"].startswith("optax.") and d["rules"] == [["hidden", "tensor"]]
    assert to_dict(base)["loss"] is None and to_dict(base)["rules"] == []
    hashes = {config_hash(base), config_hash(hooked)}
    hashes.add(config_hash(TrainConfig(model=MLPConfig(), rules=(("hidden", "fsdp"),))))
    assert len(hashes) == 3


def test_progress_line_shows_the_loss_metrics():
    import io

    from jaxpar.rundir.writer import Progress
    from jaxpar.worker.training import loss_metrics

    line = {"step": 3, "loss": 0.5, "lr": 0.1, "grad_norm": 2.0, "accuracy": 0.75,
            "samples_per_s": 10.0, "mfu": None, "time": 1.0}  # fmt: skip
    assert loss_metrics(line) == {"accuracy": 0.75}
    out = io.StringIO()
    Progress(3, enabled=True, stream=out).update(3, 0.5, 10.0, "samples", loss_metrics(line))
    assert "loss 0.5000 accuracy 0.7500 10 samples/s" in out.getvalue()


def test_an_unannotated_model_is_warned_about():
    from jaxpar.contract import unsharded_warning

    assert "nothing is sharded" in unsharded_warning({"w": None, "b": {"x": None}})
    assert "nothing is sharded" in unsharded_warning({"w": (None, None)})
    assert unsharded_warning({"w": ("embed", None), "b": None}) is None


def test_a_shorter_partition_spec_leaves_the_last_dimensions_unnamed(devices8):
    import pytest
    from jax.sharding import PartitionSpec

    from jaxpar import build_mesh
    from jaxpar.engine.rules import PARAM_RULES, named_sharding

    mesh = build_mesh("data=2,tensor=4", devices8)
    sh = named_sharding("w", (16, 8, 4), PartitionSpec(None, "mlp"), PARAM_RULES, mesh)
    assert sh.spec == PartitionSpec(None, "tensor", None)
    with pytest.raises(ValueError, match="3 logical names"):
        named_sharding("b", (16, 8), (None, "mlp", None), PARAM_RULES, mesh)
