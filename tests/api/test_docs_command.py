"""`jaxpar docs [TOPIC]` prints the user guides, which ship inside the package; `--help` texts name
no file of the repository (a wheel user has none)."""

from __future__ import annotations

import re

import pytest

from jaxpar import cli
from tests.support.hardening_util import call
from tests.support.helpers import REPO

COMMANDS = ([], ["train"], ["launch"], ["data"], ["data", "prepare"], ["sample"], ["export"],
            ["report"], ["inspect"], ["bench"], ["docs"])  # fmt: skip


def test_docs_lists_the_topics_and_prints_one(capsys):
    assert call(cli.main, ["docs"]) == 0
    listing = capsys.readouterr().out
    for topic in ("cluster", "data", "design", "api"):
        assert re.search(rf"^{topic}\s+\S", listing, re.M), listing
    assert call(cli.main, ["docs", "cluster"]) == 0
    page = capsys.readouterr().out
    with open(cli.docs_topics()["cluster"], encoding="utf-8") as f:
        assert page == f.read()


def test_an_unknown_topic_is_one_line(capsys):
    assert call(cli.main, ["docs", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no page 'nope'; topics: " in err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: "-".join(c) or "jaxpar")
def test_help_names_no_repository_file(capsys, command):
    assert call(cli.main, [*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert not re.search(r"docs/|\b[a-z_/]+\.py\b", text), text


def test_train_help_says_what_the_files_said(capsys):
    """The fault kinds' grammar and effect, and every --set key with its default."""
    from jaxpar.rundir.fault_kinds import TABLE

    assert call(cli.main, ["train", "--help"]) == 0
    text = capsys.readouterr().out
    for kind in TABLE:
        assert f"  {kind.usage}: {kind.doc}" in text
    assert "  ckpt: every=50, keep=3, restore='latest'" in text
    assert "  comm: compress='none'" in text


def test_the_readme_says_when_lr_is_logged_and_what_eval_loss_averages():
    """The metrics a run writes, as the README describes them: `lr` only where the optimizer's
    state holds it, and eval_loss's batch count with its real default."""
    from jaxpar.config import TrainLoopConfig

    readme = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
    item = readme.split("**Run directory**", 1)[1].split("- **", 1)[0]
    assert "`lr` where it is known" in item and "optax.inject_hyperparams" in item, item
    n = TrainLoopConfig().eval_batches
    assert f"`train.eval_batches` (default {n})" in item, item


def test_the_guides_name_no_source_file_of_jaxpar():
    """A wheel user reads the guides with `jaxpar docs` and has no jaxpar/ folder to open: the
    guides say what is needed themselves (the design page, for changing the code, names the
    modules it describes)."""
    found = {}
    for topic, path in cli.docs_topics().items():
        if topic != "design":
            with open(path, encoding="utf-8") as f:
                found[topic] = re.findall(r"\bjaxpar/[\w/]+\.py\b", f.read())
    assert not any(found.values()), {t: f for t, f in found.items() if f}


def test_docs_lists_and_prints_the_example_scripts_the_guides_use(capsys):
    assert call(cli.main, ["docs"]) == 0
    assert re.search(r"^examples\s+\S", capsys.readouterr().out, re.M)
    assert call(cli.main, ["docs", "examples"]) == 0
    listing = capsys.readouterr().out
    for name in ("custom_loop.py", "flax_minigpt.py", "flax_mnist_cnn.py"):
        assert re.search(rf"^examples/{name}\s+\S", listing, re.M), listing
    assert call(cli.main, ["docs", "examples/custom_loop.py"]) == 0
    script = capsys.readouterr().out
    assert script == (REPO / "docs" / "examples" / "custom_loop.py").read_text()
