"""The run directory: its schema and event names (runlog), writers, ownership and the
goodput ledger. Imports no jax: the supervisor and `jaxpar report` read runs through it."""
