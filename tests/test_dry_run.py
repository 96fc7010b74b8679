"""``build --dry-run`` refuses what ``build`` would refuse before it writes.

A dry run that passed once let ``build`` write both patched trees and then stop at the
overlays with exit 8: a target without ``pinned: true`` needs a Docker daemon. Both now run
the same preflight (pipeline.preflight) before the first step: the series, the output
folders, the daemon and images the steps need.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.patchkit import make_patch, write_series
from sm12x_bundle import config as config_mod
from sm12x_bundle import containers as engine_mod
from sm12x_bundle.cli import main
from sm12x_bundle.errors import EngineError

BODY = "".join(f"line {i}\n" for i in range(1, 31))
TARGET = "  - {name: vllm, image: vllm/vllm-openai:v0.21.0, root: /usr/lib/vllm, pinned: true}\n"


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """One lane on a local tree (no download), no Docker daemon; ``config(targets)`` writes
    sm12x-bundle.yaml with those targets."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    tree = tmp_path / "src"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "a.py").write_text(BODY)
    (tree / "PKG-INFO").write_text("Version: 0.21.0\n")
    write_series(tmp_path / "patches", {"0001-a.patch": make_patch({"vllm/a.py": (BODY, BODY.replace("line 3\n", "3\n"))})})

    def config(targets: str = "", extra: str = "") -> None:
        (tmp_path / "sm12x-bundle.yaml").write_text(
            f"lanes:\n  - {{version: '0.21.0', source: {tree}, series: patches/series}}\n"
            + (f"targets:\n{targets}" if targets else "") + extra
        )

    return tmp_path, config


def _refused_alike(capsys, argv: list[str], code: int) -> str:
    """``build --dry-run`` and ``build`` both exit ``code`` with the same sentence."""
    assert main(["build", "-q", "--dry-run", *argv]) == code
    dry = capsys.readouterr()
    assert main(["build", "-q", *argv]) == code
    real = capsys.readouterr()
    assert (dry.out, dry.err) == ("", real.err) and real.err.count("\n") == 1
    return real.err


def test_a_target_that_needs_a_daemon_is_refused_by_the_dry_run_too(project, capsys):
    cwd, config = project
    config(TARGET.replace(", pinned: true", ""))
    before = files_under(cwd)
    err = _refused_alike(capsys, [], 8)
    assert err.startswith(f"sm12x-bundle: error: the Docker daemon at unix://{cwd}/no-daemon.sock does not answer")
    assert files_under(cwd) == before  # build no longer writes the trees first


def test_the_bundle_image_needs_a_daemon_in_the_dry_run_too(project, capsys):
    _, config = project
    config()
    err = _refused_alike(capsys, ["--image"], 8)
    assert "does not answer" in err


def test_a_pinned_target_without_root_is_refused_when_no_daemon_answers(project, capsys):
    _, config = project
    config(TARGET.replace(", root: /usr/lib/vllm", ""))
    err = _refused_alike(capsys, [], 3)
    assert err == "sm12x-bundle: error: target vllm is pinned but has no root: without Docker it must say where vLLM is\n"


class _Daemon:
    """A daemon that answers and holds only ``images``."""

    def __init__(self, images: set[str]):
        self.images = images

    def ping(self) -> None:
        pass

    def image_id(self, ref: str) -> str:
        if ref not in self.images:
            raise EngineError(f"image {ref} not found in the daemon")
        return "sha256:" + "0" * 64


def test_an_image_the_daemon_lacks_is_refused_unless_pinned(project, capsys, monkeypatch):
    _, config = project
    monkeypatch.setattr(engine_mod, "docker_engine", lambda: _Daemon(set()))
    config(TARGET.replace(", pinned: true", ""))
    assert main(["build", "-q", "--dry-run"]) == 8
    assert capsys.readouterr().err == "sm12x-bundle: error: image vllm/vllm-openai:v0.21.0 not found in the daemon\n"
    config(TARGET)  # pinned: its pinned tree stands in
    assert main(["build", "-q", "--dry-run"]) == 0


def test_output_folders_are_refused_by_the_dry_run(project, capsys):
    cwd, config = project
    config(TARGET)
    (cwd / "build" / "vllm-0.21.0-sm12x").mkdir(parents=True)
    (cwd / "build" / "vllm-0.21.0-sm12x" / "notes.txt").write_text("mine\n")
    err = _refused_alike(capsys, [], 11)
    assert "build/vllm-0.21.0-sm12x" in err
    assert main(["build", "-q", "--dry-run", "--force"]) == 0


def test_a_series_that_cannot_be_parsed_is_refused_by_the_dry_run(project, capsys):
    cwd, config = project
    config(TARGET)
    (cwd / "patches" / "0001-a.patch").write_text("not a patch\n")
    err = _refused_alike(capsys, [], 5)
    assert "no 'diff --git' section" in err


def test_the_embedded_default_cut_before_pinned_is_refused_alike(tmp_path, monkeypatch, capsys):
    """The reported case: the default cut after the second target's root (no 'pinned: true'),
    with no daemon. The dry run passed; build wrote both trees, then exited 8."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    lines = config_mod.default_text().splitlines(keepends=True)
    second = next(n for n, line in enumerate(lines) if line.startswith("  - name: vllm-openai-v0.33.0"))
    (tmp_path / "cut.yaml").write_text("".join(lines[: second + 3]))  # name, image, root
    assert main(["build", "-q", "--dry-run", "--config", "cut.yaml"]) == 8
    dry = capsys.readouterr().err
    assert main(["build", "-q", "--config", "cut.yaml"]) == 8
    assert capsys.readouterr().err == dry and "does not answer" in dry
    assert files_under(tmp_path) == ["cut.yaml"]
