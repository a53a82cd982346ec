"""A training entrypoint of your own on jaxpar's library API (`jaxpar docs api`):

    jaxpar launch --nproc 2 --devices-per-proc 4 --run-dir runs/mine -- \
        python custom_loop.py --mesh data=2,tensor=4 --steps 100
"""

import argparse
import time

import jax
import numpy as np

import jaxpar
from jaxpar.train.recipes import digits_cnn


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mesh", default="dp8")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--run-dir", default=None)  # default: jaxpar launch's --run-dir
    args = p.parse_args()
    cfg = jaxpar.apply_overrides(digits_cnn(), [f"train.steps={args.steps}"])

    job = jaxpar.build(cfg, args.mesh)  # mesh, shardings, steps; nothing allocated
    # The run's records, as `jaxpar train` keeps them (config.json, `start`), its checkpoints,
    # and (local=True) a snapshot in node RAM after every step, restored first after a failure.
    ckpt = jaxpar.CheckpointManager(jaxpar.resolve_run_dir(args.run_dir, cfg), job=job, local=True)
    run = ckpt.run  # metrics.jsonl and events.jsonl
    with ckpt:
        # newest snapshot or checkpoint, resharded onto this mesh (else a fresh state, created
        # sharded), while the step compiles or loads from RUN_DIR/compiled
        state = ckpt.restore_or_init()
        for step in range(int(state["step"]), cfg.train.steps):
            if ckpt.reached_preemption(step):  # SIGTERM: every process saves the same step
                ckpt.save(step, state)
                ckpt.wait()
                return jaxpar.EXIT_PREEMPTED  # the supervisor restarts without counting it
            # the progress heartbeat `jaxpar launch` watches for hangs; `--fault` specs
            state = ckpt.before_step(step, state)
            t0 = time.time()
            state, metrics = job.train_step(state, job.batch(step))
            metrics = jax.device_get(metrics)
            # loss, lr, accuracy, step time, samples/s ... as `jaxpar train` logs them
            line = job.metrics_line(step + 1, metrics, time.time() - t0, state)
            if not np.isfinite(line["loss"]):
                raise jaxpar.NonFiniteLoss(step + 1, line["loss"])  # exit 44: roll back
            run.metrics(line)
            ckpt.after_step(step + 1, state)  # a checkpoint every cfg.ckpt.every steps, snapshots
        evals = [job.eval_step(state, job.batch(i, split="eval")) for i in range(4)]
        eval_loss = float(np.mean([float(m["loss"]) for m in evals]))
        run.metrics({"step": cfg.train.steps, "eval_loss": eval_loss, "time": time.time()})
    return 0  # leaving `with ckpt` wrote `done` (not after an error or a preemption)


if __name__ == "__main__":
    jaxpar.entrypoint(main)  # devices, jax.distributed, exit codes for `jaxpar launch`
