"""One training process: set-up, the training loop, faults, the compiled-program cache, and the
pre-started (spare and standby) worker sides."""
