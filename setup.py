"""Which packages the jaxpar distribution installs (the rest of the metadata is pyproject.toml).

The repository's user-side folders are installed inside the `jaxpar` package, not as top-level
packages: `models/` -> `jaxpar.models`, `meshes/` -> `jaxpar.meshes`, `train/` -> `jaxpar.train`.
Top-level names as generic as `train` or `models` would collide with other projects' packages
in site-packages. In a source checkout, jaxpar/_layout.py serves the same names from the folders.
"""

from setuptools import find_packages, setup

MAPPED = {"jaxpar.models": "models", "jaxpar.meshes": "meshes", "jaxpar.train": "train"}


def packages() -> list[str]:
    found = find_packages(include=["jaxpar", "jaxpar.*"])
    for package, folder in MAPPED.items():
        found += [package, *(f"{package}.{sub}" for sub in find_packages(folder))]
    return found


# The user guides ship inside the package as data (jaxpar/docs/*.md): `jaxpar docs TOPIC` prints one;
# with them the example scripts the guides use (jaxpar/docs/examples/*.py: `jaxpar docs examples`).
DOCS = {"jaxpar.docs": "docs"}

setup(
    packages=[*packages(), *DOCS],
    package_dir={**MAPPED, **DOCS},
    package_data={"jaxpar.docs": ["*.md", "examples/*.py"]},
)
