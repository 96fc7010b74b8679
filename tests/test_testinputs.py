"""The files the tests read from PyPI: pinned by sha256 in one data file, fetched into the
tool's own cache (SM12X_BUNDLE_CACHE honoured), verified on the way in and on every use; a
test that lacks one skips, or fails under scripts/test (SM12X_REQUIRE_INPUTS=1).

The fetch runs against a local PEP 503 index (file://), so these tests need no network.
"""

from __future__ import annotations

import hashlib
import re

import needs
import pytest
import testinputs

from sm12x_bundle.errors import FetchError

DATA = b"a stand-in wheel\n" * 100


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A one-project index serving DATA, and an empty cache named by SM12X_BUNDLE_CACHE."""
    wheel = tmp_path / "files" / "demo-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(DATA)
    page = tmp_path / "index" / "demo" / "index.html"
    page.parent.mkdir(parents=True)
    sha = hashlib.sha256(DATA).hexdigest()
    page.write_text(f'<a href="{wheel.as_uri()}#sha256={sha}">{wheel.name}</a>\n')
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "index").as_uri())
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    return {"project": "demo", "filename": wheel.name, "sha256": sha}, wheel, tmp_path / "cache"


def test_every_input_is_pinned_by_sha256():
    entries = testinputs.inputs()
    assert entries, "tests/data/test-inputs.json lists no input"
    for name, entry in entries.items():
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), name
        assert entry["filename"] and entry["project"] and entry["why"], name
    assert entries["flashinfer-python"]["filename"] == "flashinfer_python-0.7.2.post1-py3-none-any.whl"


def test_an_input_lands_in_the_tool_cache_and_is_used_from_there(index):
    entry, wheel, cache = index
    path = testinputs.fetch_entry(entry)
    assert path == cache / "test-inputs" / entry["sha256"] / entry["filename"]
    assert path.read_bytes() == DATA
    wheel.unlink()  # the index can no longer serve it: the cached copy is used
    assert testinputs.fetch_entry(entry) == path


def test_a_damaged_cached_copy_is_discarded_and_fetched_again(index):
    entry, _, _ = index
    path = testinputs.fetch_entry(entry)
    path.write_bytes(b"damaged")
    assert testinputs.fetch_entry(entry).read_bytes() == DATA


def test_bytes_that_do_not_match_the_pin_are_not_kept(index):
    entry, wheel, cache = index
    wheel.write_bytes(b"something else")
    with pytest.raises(FetchError, match="sha256 mismatch"):
        testinputs.fetch_entry(entry)
    assert not list(cache.rglob("*.whl")) and not list((cache / "tmp").iterdir())


def test_an_index_that_lists_another_sha256_is_refused(index):
    entry, _, cache = index
    with pytest.raises(FetchError, match="refusing it"):
        testinputs.fetch_entry({**entry, "sha256": "0" * 64})
    assert not (cache / "test-inputs").exists()


def test_a_missing_input_skips_a_test_or_fails_it_under_scripts_test(monkeypatch):
    monkeypatch.setattr(needs, "REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match="no such input"):
        needs.missing("no such input")
    monkeypatch.setattr(needs, "REQUIRED", True)
    with pytest.raises(pytest.fail.Exception, match="SM12X_REQUIRE_INPUTS=1 .* but no such input"):
        needs.missing("no such input")


def test_scripts_test_fetches_the_inputs_and_requires_them():
    text = (testinputs.DATA.parents[2] / "scripts" / "test").read_text()
    assert "python3 tests/testinputs.py" in text and "export SM12X_REQUIRE_INPUTS=1" in text
    assert text.index("tests/testinputs.py") < text.index("python3 -m pytest")

