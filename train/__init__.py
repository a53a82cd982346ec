"""Training recipes and the entrypoint `python -m train` (run from the checkout)."""
