"""What `jaxpar launch` shows on its console of the workers: a failed worker's last lines without
gloo's connection messages (they stay in logs/), and each step's status line once."""

from __future__ import annotations

from jaxpar.supervisor.incarnation import console_tail, status_line


def test_gloo_connection_lines_stay_out_of_the_console_tail():
    gloo = [f"[Gloo] Rank {r} is connected to 7 peer ranks. Expected number of connected peer "
            f"ranks is : 7\n" for r in range(8)]  # fmt: skip
    log = "".join(["jaxpar: gpt_tiny: mesh data=8\n", *gloo, "Traceback (most recent call last):\n",
                   "ValueError: boom\n", *gloo[:2]])  # fmt: skip
    assert console_tail(log) == [
        "jaxpar: gpt_tiny: mesh data=8\n", "Traceback (most recent call last):\n",
        "ValueError: boom\n",
    ]  # fmt: skip
    assert console_tail("".join(gloo)) == []  # nothing worth echoing
    many = "".join(f"line {i}\n" for i in range(30)) + "".join(gloo)
    assert console_tail(many) == [f"line {i}\n" for i in range(18, 30)]
    assert console_tail("[Gloo] something else\n") == ["[Gloo] something else\n"]


def test_a_step_is_reported_once():
    said = None
    shown = []
    for step in (None, 0, 0, 0, 3, 3, 7):  # a long compile keeps step 0 for several periods
        line = status_line(0, step, 0.5 if step else None, said)
        if line:
            said = step
            shown.append(line)
    assert shown == ["incarnation 0: step 0", "incarnation 0: step 3, 0.50s/step",
                     "incarnation 0: step 7, 0.50s/step"]  # fmt: skip
