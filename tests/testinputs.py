#!/usr/bin/env python3
"""Files the tests read that no package install provides, fetched like the tool's own inputs.

Each is listed once, with PyPI's sha256, in tests/data/test-inputs.json. It is looked up in
the package index the tool uses (PIP_INDEX_URL, pip's configuration, else PyPI), downloaded
into the tool's cache (SM12X_BUNDLE_CACHE, else $XDG_CACHE_HOME/sm12x-bundle, else
~/.cache/sm12x-bundle) as ``test-inputs/<sha256>/<filename>``, and hashed on the way in and
on every use: a copy that does not match is discarded, never used.

    python3 tests/testinputs.py            # fetch every input (scripts/test runs this)

A test asks for one with ``needed(name)``: the cached file, fetched first if it is not
there; where it cannot be had, needs.missing() skips the test, or fails it under
scripts/test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "test-inputs.json"
SHELF = "test-inputs"


def inputs() -> dict[str, dict]:
    return {k: v for k, v in json.loads(DATA.read_text("utf-8")).items() if not k.startswith("_")}


def fetch(name: str, cache: Path | None = None, progress=None) -> Path:
    """The verified cached file of input ``name``, downloaded first when it is missing or damaged."""
    return fetch_entry(inputs()[name], cache, progress)


def fetch_entry(entry: dict, cache: Path | None = None, progress=None) -> Path:
    """``entry`` (project, filename, sha256) from the cache, or from the index into it."""
    from sm12x_bundle.errors import FetchError
    from sm12x_bundle.source import cache as cache_mod
    from sm12x_bundle.source import fetch as fetch_mod
    from sm12x_bundle.source import index

    cache = cache or cache_mod.cache_dir()
    sha, filename = entry["sha256"], entry["filename"]
    found = fetch_mod.cached_file(cache, sha, filename, folder=SHELF, progress=progress)
    if found is not None:
        return found
    url, listed = index.find_file(index.index_url(), entry["project"], filename)
    if listed and listed != sha:
        raise FetchError(f"the index lists sha256 {listed} for {filename}, but {DATA.name} says {sha}: refusing it")
    return fetch_mod.download(url, sha, cache, filename, folder=SHELF, progress=progress)


def needed(name: str) -> Path:
    """For a test: the input's path, or needs.missing() with the reason it cannot be had."""
    import needs

    from sm12x_bundle.errors import BundleError

    try:
        return fetch(name)
    except BundleError as exc:
        needs.missing(f"the test input {name} cannot be fetched: {exc}")
        raise  # not reached


def main() -> int:
    from sm12x_bundle.errors import BundleError
    from sm12x_bundle.progress import Progress

    for name in inputs():
        try:
            print(fetch(name, progress=Progress.stderr()))
        except BundleError as exc:
            print(f"testinputs: error: {name}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
