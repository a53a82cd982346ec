"""Process set-up before jax starts: simulated CPU devices, and jax.distributed from the environment."""

from __future__ import annotations

import os


def configure_devices() -> None:
    """Give the CPU backend simulated devices unless XLA_FLAGS already sets a count.

    JAXPAR_DEVICES_PER_PROC (set by `jaxpar launch`) wins; otherwise 8. Only affects the CPU
    backend, so it is harmless where an accelerator is present. Must run before jax's first use.
    """
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    per_proc = os.environ.get("JAXPAR_DEVICES_PER_PROC")
    if per_proc:
        jax.config.update("jax_num_cpu_devices", int(per_proc))
    elif "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", 8)


def initialize_from_env() -> bool:
    """Start jax.distributed when the environment describes a multi-process job."""
    addr = os.environ.get("JAXPAR_COORDINATOR")
    if not addr:
        return False
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        addr,
        num_processes=int(os.environ["JAXPAR_NUM_PROCESSES"]),
        process_id=int(os.environ["JAXPAR_PROCESS_ID"]),
    )
    return True


def process_index() -> int:
    import jax

    return jax.process_index()
