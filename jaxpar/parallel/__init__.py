"""Parallelism strategies: how one optimizer step runs on the mesh (see base.py for the
interface and plan.py for which strategy a config and mesh get)."""
