"""`jaxpar bench SUITE`: the benchmark suites (harness.py holds the registry, the runner and the writer)."""
