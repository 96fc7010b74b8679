"""The repository's own tooling: the registry of generated files (generated.py), the examples
the golden files are rendered from (golden/) and the tests' patch builder (patchkit.py).

Not part of sm12x_bundle and never installed: bin/regenerate and the tests import it from the
checkout (pyproject.toml puts the repository root on pytest's path).
"""
