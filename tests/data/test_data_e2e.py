"""End to end on a prepared corpus: train gpt_tiny on token shards (fsdp2 x tp4), resume after a
kill bitwise, read it from 2 processes, sample and export the resumed run; a user's own source
(on the default dp8 mesh)."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

from jaxpar.data import sources as data_lib
from jaxpar.rundir.runlog import read_jsonl
from tests.support.helpers import REPO, SMALL_MODEL, cpu_env, losses, ok, run, train_cmd

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 6
FSDP_TP = "data=1,fsdp=2,tensor=4"


def tokens_cmd(run_dir, corpus, *args, steps=STEPS, faults=()):
    """gpt_tiny one layer of width 64 (helpers.SMALL_MODEL: the data path, not the model, is the
    point) on the recipe's batches of 32 x 64 tokens."""
    return train_cmd(
        run_dir, "--set", "data.source=tokens", "--set", f"data.path={corpus}",
        "--set", f"ckpt.every={EVERY}", "--set", f"train.eval_every={STEPS}", *SMALL_MODEL,
        *args, steps=steps, faults=faults,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokens_run(tokens_corpus, tmp_path_factory):
    """gpt_tiny trained 12 steps on the token shards on data=1,fsdp=2,tensor=4, killed at step 9
    and resumed (the run directory the tests below read: its losses, a sample, an export)."""
    run_dir = tmp_path_factory.mktemp("tokens-fsdp-tp") / "run"
    # without the local snapshot tier: the resume starts from the step-6 checkpoint, so steps 7
    # and 8 are computed twice, once before the kill and once after (saved synchronously: the
    # small model's steps are milliseconds, and an asynchronous save could be in flight at 9)
    cmd = tokens_cmd(run_dir, tokens_corpus, "--mesh", FSDP_TP, "--set", "ckpt.local_every=0",
                     "--set", "ckpt.use_async=false", faults=["kill@9"])  # fmt: skip
    # the tests' fast-compiling XLA flags (helpers.cpu_env): 18 steps of this program cost less
    # than its optimised compilation (~10 CPU-s of the two runs' 21 with XLA_OPT_FLAGS)
    killed = run(cmd).returncode
    ok(run(cmd))  # the fault fired once; resumes from the step-6 checkpoint
    return run_dir, killed


def test_trains_on_tokens_with_the_vocabulary_of_meta_json(tokens_run):
    run_dir, _ = tokens_run
    config = json.load(open(run_dir / "config.json"))
    assert config["model"]["vocab_size"] == 512 and config["data"]["source"] == "tokens"
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[STEPS] < got[1] - 0.3, got


def test_fsdp_tp_kill_and_resume_is_bitwise_identical(tokens_run):
    run_dir, killed = tokens_run
    assert killed == -signal.SIGKILL
    lines = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    first = {m["step"]: m["loss"] for m in lines if m["incarnation"] == 0}
    second = {m["step"]: m["loss"] for m in lines if m["incarnation"] == 1}
    assert sorted(first) == list(range(1, 9)) and sorted(second) == list(range(7, STEPS + 1))
    assert [first[s] for s in (7, 8)] == [second[s] for s in (7, 8)]  # bitwise, same mesh


def test_two_processes_read_the_same_global_batches(tokens_run, tokens_corpus, tmp_path):
    """2 processes x 4 devices each read their half of every batch (fsdp=2: one half per
    process): the losses are those of the one-process run (any missing, repeated or swapped row
    would change them)."""
    run_dir = tmp_path / "run"
    worker = tokens_cmd(run_dir, tokens_corpus, "--mesh", FSDP_TP, "--set", "ckpt.every=0",
                        steps=3)  # fmt: skip
    launch = [sys.executable, "-m", "jaxpar.cli", "launch", "--nproc", "2",
              "--devices-per-proc", "4", "--run-dir", str(run_dir), "--", *worker]  # fmt: skip
    ok(run(launch, env=cpu_env(devices=None)))
    two, one = losses(run_dir), losses(tokens_run[0])
    assert sorted(two) == [1, 2, 3]
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [one[s] for s in (1, 2, 3)], rtol=1e-5)


def jaxpar(*args: str) -> str:
    cmd = [sys.executable, "-m", "jaxpar.cli", *args]
    return ok(run(cmd, env=cpu_env(devices=1), timeout=600)).stdout


def test_greedy_sample_is_deterministic_and_continues_the_prompt(tokens_run):
    prompt = "def dumps(obj"
    args = ["sample", str(tokens_run[0]), "--prompt", prompt, "--temperature", "0",
            "--max-new-tokens", "20"]  # fmt: skip
    first = jaxpar(*args)
    assert first == jaxpar(*args)
    # 20 tokens more (the small model, 12 steps in, may well continue with whitespace)
    assert first.startswith(prompt) and len(first) > len(prompt)


def test_exported_parameters_give_the_checkpoints_eval_loss(tokens_run, tokens_corpus, tmp_path):
    from jaxpar.tools.export import config_path, load_model

    run_dir, _ = tokens_run
    out = str(tmp_path / "gpt.safetensors")
    jaxpar("export", str(run_dir), "--out", out)
    meta = json.load(open(config_path(out)))
    assert meta["step"] == STEPS and meta["model"]["vocab_size"] == 512
    from safetensors.numpy import load_file

    names = set(load_file(out))
    assert {"tok_emb", "head", "blocks.w_qkv", "ln_f.scale"} <= names
    assert not any("opt" in n or "mu" in n for n in names)  # parameters only
    model = load_model(out)
    source = data_lib.make_source("tokens", seq_len=64, path=tokens_corpus)
    forward = jax.jit(lambda tokens: model(tokens))
    got = []
    for i in range(2):  # the run's eval: train.eval_batches=2 batches of 32 from the eval split
        batch = data_lib.global_batch(source, step=i, global_batch=32, seed=0, split="eval")
        logits = forward(batch["inputs"]).astype(np.float32)
        got.append(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean())
    (logged,) = [m["eval_loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in m]
    np.testing.assert_allclose(float(np.mean(got)), logged, rtol=1e-5)


USER_SOURCE = '''
    """A user's own data source: counting sequences (token t+1 follows token t)."""
    import numpy as np


    class Counting:
        name, kind = "counting", "lm"

        def __init__(self, args):
            self.seq_len, self.vocab_size, self.seed = args.seq_len, args.vocab_size, args.seed

        def size(self, split):
            return None  # keyed: any index is an example

        def example(self, index, split):
            rng = np.random.default_rng([self.seed, split == "eval", index])
            w = (rng.integers(0, self.vocab_size) + np.arange(self.seq_len + 1)) % self.vocab_size
            return {"inputs": w[:-1].astype(np.int32), "targets": w[1:].astype(np.int32)}
'''


def test_a_user_source_trains_without_jaxpar_changes(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_corpus.py").write_text(textwrap.dedent(USER_SOURCE))
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(project), str(REPO),
                                                    env.get("PYTHONPATH")) if p)  # fmt: skip
    run_dir = tmp_path / "run"
    cmd = train_cmd(run_dir, "--set", "data.source=my_corpus:Counting", "--set", "ckpt.every=0",
                    "--set", "train.eval_every=0", *SMALL_MODEL, steps=8)  # fmt: skip
    ok(run(cmd, env=env))
    assert json.load(open(run_dir / "config.json"))["data"]["source"] == "my_corpus:Counting"
    got = losses(run_dir)
    assert got[8] < got[1] - 0.3, got
