"""The fault table (jaxpar/rundir/fault_kinds.py) and its implementations (jaxpar/worker/faults.py)
agree: one implementation per kind, of the shape its injection point calls, every exception named
in the table is one the loop raises, and the timeline's ending faults are the table's."""

import inspect
import re

import jax.numpy as jnp
import pytest

from jaxpar.recovery.checkpoint import Preempted, ReplicaMismatch
from jaxpar.rundir import fault_kinds, runlog
from jaxpar.rundir.writer import RunDir
from jaxpar.worker import faults
from jaxpar.worker.faults import FaultSpec, NonFiniteLoss

# arguments of an implementation at each injection point: (faults, at) or (faults, at, state)
ARITY = {"before_step": 2, "on_state": 3, "before_commit": 2, "before_snapshot": 2,
         "before_give": 2, "before_average": 3, "inside_average": 2}  # fmt: skip


def test_every_kind_has_one_implementation_and_every_implementation_a_kind():
    assert set(fault_kinds.POINTS) == set(ARITY)
    assert len(set(fault_kinds.KINDS)) == len(fault_kinds.KINDS)
    assert set(faults.IMPLEMENTATIONS) == set(fault_kinds.KINDS)
    assert faults.KINDS == fault_kinds.KINDS
    assert sorted(k for p in fault_kinds.POINTS for k in fault_kinds.at(p)) == sorted(
        fault_kinds.KINDS
    )
    for kind in fault_kinds.TABLE:
        impl = faults.IMPLEMENTATIONS[kind.name]
        assert len(inspect.signature(impl).parameters) == ARITY[kind.at], kind.name
    assert faults.EVERY_PROCESS <= set(fault_kinds.KINDS)


def test_each_kinds_grammar_parses():
    for kind in fault_kinds.TABLE:
        assert kind.usage.startswith(f"{kind.name}@S"), kind.name
        example = re.sub(r"\[[^\]]*\]", "", kind.usage).replace("@S", "@3")
        example = re.sub(r"=[PXN]\b", "=1", example)
        assert FaultSpec.parse(example).kind == kind.name, example


def test_exceptions_named_in_the_table_are_the_loops():
    loop_errors = {e.__name__ for e in (NonFiniteLoss, ReplicaMismatch, Preempted)}
    named = {k.raises for k in fault_kinds.TABLE if k.raises}
    assert named == loop_errors
    assert fault_kinds.raised_as("NonFiniteLoss") == ("nan",)
    with pytest.raises(ValueError, match="injection point"):
        fault_kinds.at("during_step")


def test_the_timeline_ends_incidents_on_the_tables_ending_faults():
    assert runlog.ENDING_FAULTS == fault_kinds.ENDING
    assert set(fault_kinds.ENDING) == {
        "kill", "hang", "sigterm", "nan", "killsave", "killsnap", "losthost", "killgive",
        "nangrad", "killavg",
    }  # fmt: skip
    for kind in fault_kinds.TABLE:
        inc = runlog.Incarnation(index=0, start=0.0)
        event = runlog.WorkerEvent.FAULT_INJECTED
        inc.events = [{"event": event, "kind": kind.name, "spec": f"{kind.name}@2"}]
        found = inc.ending_fault()
        assert (found is not None) == kind.ends, kind.name


def test_an_error_an_injected_fault_caused_names_it(tmp_path):
    run = RunDir(str(tmp_path / "run"))
    f = faults.Faults(faults.parse_all(["nan@2", "sigterm@5"]), run, process_index=0)
    for step in range(3):
        f.on_state(step, {"params": {"w": jnp.ones(2)}})
    assert f.fired == ["nan@2"]
    err = NonFiniteLoss(2, float("nan"))
    f.name_in(err)
    assert str(err).endswith("(injected fault nan@2)")
    other = ReplicaMismatch("replicas differ")
    f.name_in(other)  # diverge did not fire: the message stays
    assert str(other) == "replicas differ"
