"""`build`: the plan (pure) and the whole pipeline on the embedded default."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path

import pytest

from sm12x_bundle import pipeline
from sm12x_bundle.cli import main
from sm12x_bundle.context import Context
from sm12x_bundle.progress import Progress


def test_plan_of_the_embedded_default(default_context):
    steps = pipeline.plan(default_context)
    assert [(s.name, s.destination) for s in steps] == [
        ("pin", "the cache"),
        ("check", "-"),
        ("tree", "build/vllm-0.21.0-sm12x"),
        ("tree", "build/vllm-0.33.0-sm12x"),
        ("overlays", "overlays/"),
        ("nomad", "build/nomad/"),
    ]


def test_plan_follows_the_config(default_context):
    config = dataclasses.replace(default_context.config, jobs=(), targets=())
    steps = pipeline.plan(Context(config, Progress.quiet()), build_image=True)
    assert [s.name for s in steps] == ["pin", "check", "tree", "tree", "image"]


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    assert main(["build", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3. tree 0.21.0    -> build/vllm-0.21.0-sm12x" in out and "4. tree 0.33.0    -> build/vllm-0.33.0-sm12x" in out
    assert "1. pin            -> the cache" in out
    assert list(tmp_path.iterdir()) == []


def test_progress_lines_name_the_lane(default_context, tmp_path):
    """Two lanes' tree steps must not print the same progress line."""
    said = io.StringIO()
    steps = [dataclasses.replace(s, run=lambda run: "ok") for s in pipeline.plan(default_context)]
    ctx = Context(default_context.config, Progress(said))
    pipeline.run_steps(ctx, steps, tmp_path, verify=None, force=False)
    assert said.getvalue().splitlines() == [
        "== [1/6] pin", "== [2/6] check", "== [3/6] tree 0.21.0", "== [4/6] tree 0.33.0",
        "== [5/6] overlays", "== [6/6] nomad",
    ]


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.integration
@pytest.mark.native
def test_build_on_the_default_without_a_daemon(tmp_path, monkeypatch, capsys, pinned_source):
    """The README's first command: works on a machine with no Docker daemon, same bytes twice."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    assert main(["build", "-q"]) == 0
    out = capsys.readouterr().out
    for word in ("pin", "check", "tree", "overlays", "nomad"):
        assert any(line.startswith(word) for line in out.splitlines()), word
    assert "sha256 05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058 verified" in out
    tree = tmp_path / "build" / "vllm-0.21.0-sm12x"
    assert (tree / "vllm" / "device_allocator" / "cumem.py").read_bytes() != (
        pinned_source.root / "vllm" / "device_allocator" / "cumem.py"
    ).read_bytes()
    assert (tmp_path / "build" / "vllm-0.33.0-sm12x" / "vllm" / "device_allocator" / "cumem.py").is_file()
    manifest = json.loads((tmp_path / "overlays" / "vllm-openai-v0.21.0" / "current.json").read_text())
    spec = json.loads((tmp_path / "build" / "nomad" / "dsv4-flash.nomad.json").read_text())
    mounted = json.dumps(spec)
    assert manifest["content_hash"] in mounted  # the specs mount this very overlay
    first = _digests(tmp_path / "build") | _digests(tmp_path / "overlays")
    assert main(["build", "-q"]) == 0
    assert _digests(tmp_path / "build") | _digests(tmp_path / "overlays") == first
