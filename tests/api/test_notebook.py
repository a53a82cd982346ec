"""train/demo.ipynb executes on CPU with tiny settings (so the Colab demo cannot rot), outputs stay
stripped in the repo, and the recovery run it makes carries a restart and a rendered report."""

from __future__ import annotations

import json
import os

import nbformat
import pytest

from tests.support.helpers import SMALL, XLA_TEST_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "train", "demo.ipynb")


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_notebook_executes_on_cpu(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("JAXPAR_DEMO_STEPS", "2")  # gpt_small: compile, 2 steps, a loss plot
    # gpt_small made smaller (SMALL) too: the notebook's cells, not its models, are the point
    monkeypatch.setenv("JAXPAR_DEMO_SET", " ".join(SMALL[1::2]))
    monkeypatch.setenv("JAXPAR_DEMO_RECOVERY_STEPS", "6")  # checkpoint every 2, kill at 5
    # the recovery job's gpt_tiny made smaller (SMALL): its story, not its model, is the point
    monkeypatch.setenv("JAXPAR_DEMO_RECOVERY_SET", " ".join(SMALL[1::2]))
    monkeypatch.setenv("JAXPAR_DEMO_RECOVERY_XLA_FLAGS", XLA_TEST_FLAGS)  # a few small steps
    monkeypatch.setenv("JAXPAR_DEMO_AUDIT", "0")
    monkeypatch.setenv("JAXPAR_DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # both models small: compiling fast pays (tests.support.helpers.XLA_TEST_FLAGS); with the
    # full gpt_small, optimised code paid (its steps ran 2-4x slower unoptimised)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {XLA_TEST_FLAGS}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, timeout=1500, kernel_name="python3",
        resources={"metadata": {"path": os.path.join(REPO, "train")}},
    )  # fmt: skip
    try:
        client.execute()  # raises CellExecutionError with the failing cell's traceback
    finally:
        nbformat.write(nb, str(tmp_path / "demo.executed.ipynb"))  # to read what it showed

    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )
    assert "8 x cpu (cpu)" in text  # 8 simulated devices
    rec = tmp_path / "demo-recovery"
    assert json.loads((rec / "config.json").read_text())["model"]["n_layers"] == 1  # SMALL
    events = [json.loads(line) for line in open(rec / "events.jsonl")]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 2, [e["event"] for e in events]
    assert any(e["event"] == "fault_injected" for e in events)
    assert any(e["event"] == "restore" and e["step"] == 4 for e in events)
    report = (rec / "report" / "report.md").read_text()
    assert "restart" in report
    for name in ("loss.png", "goodput.png", "step_time.png"):
        assert (rec / "report" / name).stat().st_size > 0
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images >= 4
    small = tmp_path / "demo-gpt_small"
    assert (small / "tensorboard").is_dir()
    assert json.loads((small / "config.json").read_text())["model"]["n_layers"] == 1  # SMALL
