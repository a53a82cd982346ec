"""A user's own project, kept outside jaxpar's packages: a model, a loss, an optax chain, recipes
(`jaxpar train --recipe my_project.recipes:digits_bn`) and an entrypoint (`python -m
my_project.train`) that uses the library API. Nothing here imports jaxpar internals."""
