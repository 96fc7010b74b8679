"""The daemon tests leave no images behind (tests/docker_support.py), checked without a daemon:
the stand-in base carries the test label that every image built from it inherits, and the
``daemon`` fixture's finalizer prunes what carries it, and only that."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest

import docker_support
from sm12x_bundle.errors import EngineError


class FakeAPI:
    def __init__(self, builds_fail: bool = False):
        self.calls: list[tuple] = []
        self.builds_fail = builds_fail

    def import_image(self, **kwargs):
        self.calls.append(("import_image", kwargs))

    def prune_containers(self, filters):
        self.calls.append(("prune_containers", filters))

    def prune_images(self, filters):
        self.calls.append(("prune_images", filters))
        return {"ImagesDeleted": [{"Untagged": "sm12x-standin/base:x"}, {"Deleted": "sha256:aa"}, {"Deleted": "sha256:bb"}]}

    def prune_builds(self):
        self.calls.append(("prune_builds",))
        if self.builds_fail:
            raise docker.errors.APIError("builder API not supported")


class FakeEngine:
    def __init__(self, api: FakeAPI, labels: dict[str, str] | None = None):
        self.client = type("Client", (), {"api": api})()
        self.labels = labels

    def image_id(self, ref):
        if self.labels is None:
            raise EngineError(f"image {ref} not found")
        return "sha256:base"

    def image_labels(self, ref):
        return dict(self.labels or {})


LABEL = {"label": docker_support.TEST_LABEL}


def test_removes_the_labelled_containers_then_images_and_no_others():
    api = FakeAPI()
    removed = docker_support.remove_test_images(FakeEngine(api), build_cache=False)
    assert removed == ["sha256:aa", "sha256:bb"]
    assert api.calls == [("prune_containers", LABEL), ("prune_images", {**LABEL, "dangling": False})]


def test_the_private_daemon_loses_its_build_cache_too():
    api = FakeAPI(builds_fail=True)  # a daemon without the builder API: nothing to prune, no error
    docker_support.remove_test_images(FakeEngine(api), build_cache=True)
    assert api.calls[-1] == ("prune_builds",)


@pytest.mark.parametrize("labels", [None, {}], ids=["missing", "unlabelled"])
def test_the_stand_in_base_is_imported_with_the_label(tmp_path, monkeypatch, labels):
    """Every image the tests build descends from it, so each inherits the label; a base an
    earlier session imported without the label is imported again."""
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(docker_support, "base_key", lambda: "k")
    monkeypatch.setattr(docker_support, "base_tarball", lambda key: tmp_path / "rootfs.tar")
    api = FakeAPI()
    tag = docker_support.ensure_base(FakeEngine(api, labels))
    assert api.calls == [("import_image", {"src": str(tmp_path / "rootfs.tar"), "repository": "sm12x-standin/base",
                                           "tag": tag.partition(":")[2], "changes": [f"LABEL {docker_support.TEST_LABEL}=1"]})]


def test_a_labelled_base_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(docker_support, "base_key", lambda: "k")
    api = FakeAPI()
    docker_support.ensure_base(FakeEngine(api, {docker_support.TEST_LABEL: "1"}))
    assert api.calls == []


def _session(monkeypatch, api: FakeAPI) -> None:
    """Run the daemon fixture as pytest would: up, the session's tests, then its finalizer."""
    monkeypatch.setattr(docker_support, "engine_or_skip", lambda: FakeEngine(api))
    fixture = docker_support.daemon.__wrapped__  # the function under the fixture
    session = fixture()
    assert isinstance(next(session), FakeEngine)
    assert api.calls == []  # nothing is removed while the tests run
    with pytest.raises(StopIteration):
        next(session)


def test_the_daemon_fixture_removes_the_images_at_the_end_of_the_session(monkeypatch):
    monkeypatch.delenv("SM12X_KEEP_TEST_IMAGES", raising=False)
    api = FakeAPI()
    _session(monkeypatch, api)
    assert ("prune_images", {**LABEL, "dangling": False}) in api.calls


def test_keep_test_images_keeps_them(monkeypatch):
    monkeypatch.setenv("SM12X_KEEP_TEST_IMAGES", "1")
    api = FakeAPI()
    _session(monkeypatch, api)
    assert api.calls == []


def test_the_docker_tests_take_the_daemon_from_docker_support():
    """Each daemon test module uses this fixture (so its finalizer runs), not one of its own."""
    for name in ("test_image.py", "test_overlay_docker.py", "test_containers.py"):
        text = (Path(__file__).parent / name).read_text()
        assert "from docker_support import" in text and "def daemon(" not in text, name
