"""The engine: mesh axes, logical-axis rules, precision, the model wrapper, losses and the
collective audit. Models and strategies are built on it."""
