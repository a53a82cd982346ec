"""A training entrypoint of your own on jaxpar's library API (docs/api.md):

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

    job = jaxpar.build(cfg, args.mesh)  # mesh, shardings, compiled steps; nothing allocated
    run = jaxpar.RunDir(jaxpar.resolve_run_dir(args.run_dir, cfg), jax.process_index())
    ckpt = jaxpar.CheckpointManager(run.path, config=cfg)
    state = ckpt.restore(job.abstract_state)  # newest good checkpoint, resharded onto this mesh
    if state is None:
        state = job.init()  # created sharded
    start = int(state["step"])
    run.event("start", nproc=jax.process_count(), mesh=args.mesh)
    try:
        for step in range(start, cfg.train.steps):
            if ckpt.reached_preemption(step):  # SIGTERM: every process saves the same step
                ckpt.save(step, state)
                ckpt.wait()
                return jaxpar.EXIT_PREEMPTED  # the supervisor restarts without counting it
            jaxpar.heartbeat(run.path, step)  # progress, for the supervisor's hang detection
            t0 = time.time()
            state, metrics = job.train_step(state, job.batch(step))
            loss = float(metrics["loss"])
            if not np.isfinite(loss):
                raise jaxpar.NonFiniteLoss(step + 1, loss)  # exit 44: roll back
            run.metrics({"step": step + 1, "loss": loss, "accuracy": float(metrics["accuracy"]),
                         "step_time_s": time.time() - t0, "time": time.time()})
            if (step + 1) % 50 == 0 or step + 1 == cfg.train.steps:
                ckpt.save(step + 1, state)
        evals = [job.eval_step(state, job.batch(i, split="eval")) for i in range(4)]
        run.metrics({"step": cfg.train.steps, "time": time.time(),
                     "eval_loss": float(np.mean([float(m["loss"]) for m in evals]))})
    finally:
        ckpt.close()
    run.event("done", step=cfg.train.steps)
    return 0


if __name__ == "__main__":
    jaxpar.entrypoint(main)  # devices, jax.distributed, exit codes for `jaxpar launch`
