"""State that survives failures: Orbax checkpoints, the local snapshot tier, its peer copies."""
