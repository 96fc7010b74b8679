"""The bundle image: plan, render, labels, skew (a fake engine, no daemon), golden
Dockerfiles, and real builds on stand-in images (marker docker, docker_support.py).

The golden Dockerfiles are rendered by ``bin/regenerate`` from tools/golden/image.py, the
example these tests plan too; tests/test_generated.py fails while one differs from its render.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from docker_support import (  # noqa: F401  (fixtures)
    daemon,
    standin_base,
    standin_lane2,
    standin_novllm,
    standin_official,
    standin_opt,
    standin_skew,
    unavailable,
)
from tools.golden.image import (
    BASE_DIGEST,
    BASE_ID,
    COMPAT,
    CPP_NEW,
    CUMEM_NEW,
    CUMEM_OLD,
    EPOCH,
    example_context,
    fake_base,
    fake_target,
    make_plan,
    write_example_series,
    write_tree,
)
from tools.patchkit import make_patch, write_series

from sm12x_bundle import config as config_mod
from sm12x_bundle.cli import main
from sm12x_bundle.context import Context
from sm12x_bundle.containers import OFFICIAL_VLLM_ROOT
from sm12x_bundle.errors import (
    ApplyError,
    CommandError,
    ConfigError,
    EngineError,
    SeriesError,
    VerifyError,
)
from sm12x_bundle import containers as containers_mod
from sm12x_bundle.outputs import dockerfile, image, manifest, native_build, verify
from sm12x_bundle.outputs.tree import patched_files
from sm12x_bundle.plan import files as plan_files
from sm12x_bundle.progress import Progress
from sm12x_bundle.series.patch import load_series
from lanekit import native_fixes  # noqa: E402


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- a small vLLM-shaped tree and series ----------------------------------------------


@pytest.fixture
def tree(tmp_path) -> Path:
    return write_tree(tmp_path)


@pytest.fixture
def series_file(tmp_path) -> Path:
    return write_example_series(tmp_path)


@pytest.fixture
def ctx(tmp_path, tree, series_file) -> Context:
    return example_context(tmp_path, tree, series_file)


# --- a fake engine ---------------------------------------------------------------------


@dataclasses.dataclass
class FakeImage:
    id: str
    files: dict[str, bytes]
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    root: str | None = OFFICIAL_VLLM_ROOT
    problems: list[str] = dataclasses.field(default_factory=list)
    repo_digests: list[str] = dataclasses.field(default_factory=list)


def dockerfile_labels(text: str) -> dict[str, str]:
    """LABEL as the classic builder reads it: continuation lines joined; in double quotes
    a backslash escapes the next character (checked against a real daemon)."""
    joined = text.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("LABEL "))
    pairs = re.findall(r'(\S+?)="((?:[^"\\]|\\.)*)"', line[len("LABEL ") :])
    return {key: re.sub(r"\\(.)", r"\1", value) for key, value in pairs}


class FakeEngine:
    """Images in memory; build() understands the two rendered Dockerfiles."""

    def __init__(self, images: dict[str, FakeImage]):
        self.images = images
        self.calls: list[tuple] = []
        # what readelf -d says of the builder's extension
        self.readelf = b" 0x0000000000000001 (NEEDED)             Shared library: [libcuda.so.1]\n"

    def _get(self, ref: str) -> FakeImage:
        for key, img in self.images.items():
            if ref in (key, img.id):
                return img
        raise EngineError(f"image {ref} not found")

    def ping(self) -> None:
        self.calls.append(("ping",))

    def image_id(self, ref):
        return self._get(ref).id

    def image_labels(self, ref):
        return dict(self._get(ref).labels)

    def repo_digests(self, ref):
        return list(self._get(ref).repo_digests)

    def tag(self, ref, repository, tag):
        self.calls.append(("tag", ref, f"{repository}:{tag}"))
        self.images[f"{repository}:{tag}"] = self._get(ref)

    def read_files(self, ref, paths):
        self.calls.append(("read_files", ref, tuple(paths)))
        img = self._get(ref)
        return {p: img.files.get(p) for p in paths}

    def run(self, ref, argv, *, mounts=(), env=None, network=False, timeout=600):
        self.calls.append(("run", ref, argv[2][:40]))
        assert not network
        img = self._get(ref)
        if "SM12X-PROBE" in argv[2]:
            root = argv[3] or img.root
            wanted = json.loads(argv[4])
            files = {p: _b64(img.files.get(root + p[4:])) if root else None for p in wanted}
            answer = {"root": root or "", "found": [], "versions": {"vllm": "0.21.0"},
                      "import_error": "ModuleNotFoundError: No module named 'torch'",
                      "files": files, "bytecode": {p: [] for p in wanted},
                      "modes": {p: 0o644 for p, data in files.items() if data is not None}}
            return 0, "SM12X-PROBE " + json.dumps(answer) + "\n"
        assert argv[2] == verify.VERIFY_SCRIPT
        listed = json.loads(img.files[image.DOC_DIR + "/manifest.json"])
        counts = {"checked": len(listed["files"]), "compiled": 1, "imported": []}
        lines = [f"sm12x-verify fail {problem}" for problem in img.problems]
        return 0, "\n".join(lines + ["sm12x-verify done " + json.dumps(counts)]) + "\n"

    def build(self, context, dockerfile, tag, buildargs, progress):
        text = (context / dockerfile).read_text()
        self.calls.append(("build", tag, text))
        base_ref = next(line.split()[1] for line in text.splitlines() if line.startswith("FROM "))
        assert not base_ref.startswith("sha256:"), "BuildKit reads FROM sha256:<id> as a Docker Hub name"
        base = self._get(base_ref)
        files = dict(base.files)
        labels = dict(base.labels)
        if "build_cumem_extension" in text:
            out = native_build.BUILDER_DIR
            files[native_build.BUILDER_OUT] = (
                b"\x7fELF fake extension of " + (context / "csrc/cumem_allocator.cpp").read_bytes()
            )
            files[out + "readelf.txt"] = self.readelf
            files[out + "nm.txt"] = b"                 U memcpy@GLIBC_2.14\n"
        else:
            for path in (context / "files").rglob("*"):
                if path.is_file():
                    files["/" + str(path.relative_to(context / "files"))] = path.read_bytes()
            labels.update(dockerfile_labels(text))
        new = FakeImage("sha256:" + sha(repr(sorted(files.items())).encode()), files, labels, base.root)
        self.images[tag] = new
        return new.id

    def push(self, ref, progress):
        self.calls.append(("push", ref))


def _b64(data):
    import base64

    return None if data is None else base64.b64encode(data).decode()


@pytest.fixture
def engine(tree) -> FakeEngine:
    files = {
        OFFICIAL_VLLM_ROOT + "/" + str(p.relative_to(tree / "vllm")): p.read_bytes()
        for p in (tree / "vllm").rglob("*")
        if p.is_file()
    }
    labels = {"org.opencontainers.image.vendor": "upstream", "maintainer": "upstream"}
    return FakeEngine({"example/vllm-openai:v0.21.0": FakeImage(BASE_ID, files, labels)})


# --- the plan ---------------------------------------------------------------------------


def test_image_paths_map_patches_to_installed_files(ctx):
    assert plan_files.installed_paths(ctx.lanes[0].series) == {
        "vllm/cumem_allocator.abi3.so": ("native-fix",),
        "vllm/device_allocator/cumem.py": ("cumem-fix",),
    }


def test_a_native_patch_must_build_the_cumem_extension(tmp_path):
    bad = make_patch({"csrc/x.cpp": ("a\n", "b\n")}, "x", Sm12x_Kind="native", Sm12x_Builds="vllm/other.so")
    series = load_series(write_series(tmp_path / "p", {"0001-x.patch": bad}))
    with pytest.raises(SeriesError, match="only vllm/cumem_allocator.abi3.so"):
        plan_files.installed_paths(series)


def test_the_shipped_series_maps_into_the_image(series):
    paths = plan_files.installed_paths(series)
    assert paths["vllm/device_allocator/cumem.py"][0] == "cumem-stream-aware-free"
    assert paths["vllm/cumem_allocator.abi3.so"] == tuple(native_fixes("0.21.0"))
    assert all(p.startswith("vllm/") for p in paths)


def test_container_path():
    assert plan_files.container_path("/opt/vllm/vllm", "vllm/a/b.py") == "/opt/vllm/vllm/a/b.py"
    assert plan_files.container_path("/opt/vllm/vllm/", "vllm/x.so") == "/opt/vllm/vllm/x.so"


def test_plan_holds_patched_bytes_pre_images_and_builder_inputs(ctx):
    plan = make_plan(ctx)
    cumem, so = sorted(plan.files, key=lambda f: f.path, reverse=True)
    assert cumem.container_path == OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py"
    assert cumem.data == CUMEM_NEW.encode() and cumem.patches == ("cumem-fix",)
    assert cumem.pre_image_sha256 == sha(CUMEM_OLD.encode())
    assert so.data is None and so.pre_image_sha256 is None and so.mode == 0o755
    assert plan.builder.base == BASE_ID
    assert plan.builder.sources == {
        "csrc/cumem_allocator.cpp": CPP_NEW.encode(),
        "csrc/cumem_allocator_compat.h": COMPAT.encode(),
    }


def test_no_native_patch_no_builder(tmp_path, tree):
    series = write_series(tmp_path / "only-py", {
        "0001-cumem-fix.patch": make_patch({"vllm/device_allocator/cumem.py": (CUMEM_OLD, CUMEM_NEW)}),
    })
    text = f"pin:\n  version: '0.21.0'\n  source: {tree}\nseries: {series}\n"
    plan = make_plan(Context(config_mod.parse(text, "t.yaml", tmp_path), Progress.quiet()))
    assert plan.builder is None and [f.path for f in plan.files] == ["vllm/device_allocator/cumem.py"]


def test_labels(ctx):
    plan = make_plan(ctx, labels={"org.opencontainers.image.vendor": "upstream", "maintainer": "x"})
    s = ctx.lanes[0].series.sha256
    assert plan.labels == {
        "org.opencontainers.image.base.digest": BASE_DIGEST,
        "org.opencontainers.image.base.name": "example/vllm-openai:v0.21.0",
        "org.opencontainers.image.created": "2026-09-21T14:13:20Z",
        "org.opencontainers.image.description": "vLLM 0.21.0 with the sm12x-bundle series (cumem-fix, native-fix)",
        "org.opencontainers.image.revision": s,
        "org.opencontainers.image.source": "https://example.invalid/sm12x-bundle",
        "org.opencontainers.image.title": "sm12x-bundle",
        # upstream's OCI label is cleared, other labels are left alone
        "org.opencontainers.image.vendor": "",
        "org.opencontainers.image.version": f"0.21.0+sm12x.{s[:12]}",
        "org.sm12x-bundle.bundle": json.dumps(
            {"patches": ["cumem-fix", "native-fix"], "pin": {"sha256": None, "version": "0.21.0"},
             "series_sha256": s}, sort_keys=True, separators=(",", ":")),
    }


def test_created_comes_from_source_date_epoch_else_the_series_never_the_clock(ctx, monkeypatch):
    assert image.created_epoch(ctx.lanes[0].series, EPOCH) == 1790000000
    # without SOURCE_DATE_EPOCH: the newest Last-Update (2026-11-21 of patch 0002)
    monkeypatch.setattr(image.time, "time", lambda: 0.0)
    assert image.created_epoch(ctx.lanes[0].series, {}) == 1795219200
    with pytest.raises(ConfigError, match="SOURCE_DATE_EPOCH"):
        image.created_epoch(ctx.lanes[0].series, {"SOURCE_DATE_EPOCH": "yesterday"})


def test_same_inputs_same_plan_context_and_labels(ctx):
    a, b = make_plan(ctx), make_plan(ctx)
    assert a.labels == b.labels
    assert dockerfile.context_digest(image.bundle_context(a)) == dockerfile.context_digest(image.bundle_context(b))
    assert dockerfile.context_digest(native_build.builder_context(a.builder)) == dockerfile.context_digest(
        native_build.builder_context(b.builder)
    )


# --- version skew ------------------------------------------------------------------------


def test_skew_is_refused_naming_the_file(ctx):
    source = ctx.source()
    image.check_skew(fake_target(ctx), source)
    # another release whose cumem.py still takes the patch
    other = fake_target(ctx, {"vllm/device_allocator/cumem.py": (CUMEM_OLD + "# 0.26.0\n").encode()},
                        versions={"vllm": "0.26.0"})
    with pytest.raises(VerifyError) as err:
        image.check_skew(other, source)
    msg = str(err.value)
    assert "version skew" in msg and "it says vLLM 0.26.0" in msg
    assert OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py" in msg
    missing = dataclasses.replace(other, files=tuple(dataclasses.replace(f, pre_image_sha256=None) for f in other.files))
    with pytest.raises(VerifyError, match="absent in the image"):
        image.check_skew(missing, source)


# --- rendering ---------------------------------------------------------------------------


def test_classic_builder_syntax_only(ctx):
    plan = make_plan(ctx)
    for text in (native_build.builder_dockerfile(plan.builder), image.bundle_dockerfile(plan)):
        assert not text.startswith("# syntax")
        steps = [line for line in text.splitlines() if line and not line.startswith("#")]
        assert not [line for line in steps if "--mount" in line or "<<" in line]
        # BuildKit reads a bare id as a Docker Hub name: FROM names an image
        assert [line for line in steps if line.startswith("FROM ")] == ["FROM sm12x-bundle-pin:" + "b" * 64]


def test_no_bytecode_step_when_the_base_has_none(ctx):
    assert "RUN rm" not in image.bundle_dockerfile(make_plan(ctx))
    assert "RUN rm -f /x/__pycache__/cumem.cpython-312.pyc" in image.bundle_dockerfile(
        make_plan(ctx, bytecode={"vllm/device_allocator/cumem.py": ["/x/__pycache__/cumem.cpython-312.pyc"]})
    )


def test_label_values_survive_dockerfile_quoting(ctx):
    nasty = 'a "quoted" $HOME \\ ${X} value'
    cfg = dataclasses.replace(ctx.config.image, source_url=nasty)
    plan = image.plan_bundle(cfg, fake_target(ctx), ctx.source(), fake_base(ctx), EPOCH)
    labels = dockerfile_labels(image.bundle_dockerfile(plan))
    assert labels == plan.labels and labels["org.opencontainers.image.source"] == nasty
    with pytest.raises(ConfigError, match="control or line-separator character"):
        dockerfile.label_word("two\nlines")


def test_template_fields_must_all_be_filled():
    assert dockerfile.fill("FROM @BASE@\n# user@example.com\n", {"BASE": "x"}) == "FROM x\n# user@example.com\n"
    with pytest.raises(ConfigError, match="LABELS"):
        dockerfile.fill("FROM @BASE@\nLABEL @LABELS@\n", {"BASE": "x"})


def test_contexts_hold_only_what_the_build_needs(ctx):
    plan = make_plan(ctx)
    assert sorted(native_build.builder_context(plan.builder)) == [
        "Dockerfile", "csrc/cumem_allocator.cpp", "csrc/cumem_allocator_compat.h",
        "lib/sm12x_bundle/__init__.py", "lib/sm12x_bundle/cmd.py", "lib/sm12x_bundle/errors.py",
        "lib/sm12x_bundle/native.py",
    ]
    doc = "files" + image.DOC_DIR
    assert sorted(image.bundle_context(plan)) == sorted([
        "Dockerfile",
        f"{doc}/0001-cumem-fix.patch", f"{doc}/0002-native-fix.patch", f"{doc}/manifest.json", f"{doc}/series",
        "files" + OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so",
        "files" + OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py",
    ])


def test_manifest_schema(ctx):
    record = {"built_on": "builder image sha256:" + "c" * 64, "links": ["libcuda.so.1"]}
    plan = make_plan(ctx).with_artifact(image.NATIVE_ARTIFACT, b"\x7fELF", record)
    m = json.loads(manifest.manifest_bytes(image.manifest(plan)))
    assert set(m) == {"schema", "target", "image", "image_id", "vllm_root", "versions", "pin",
                      "series_sha256", "content_hash", "files", "native"}
    assert m["native"] == {OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so": record}
    assert m["schema"] == 1 and m["image_id"] == BASE_ID and m["vllm_root"] == OFFICIAL_VLLM_ROOT
    assert [f["container_path"] for f in m["files"]] == sorted(f["container_path"] for f in m["files"])
    so = m["files"][0]
    assert so == {
        "container_path": OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so",
        "source": "files" + OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so",
        "pre_image_sha256": None, "sha256": sha(b"\x7fELF"), "patches": ["native-fix"], "mode": "0755",
    }
    assert len(m["content_hash"]) == 16


def test_write_context_is_atomic_with_fixed_mtimes(ctx, tmp_path):
    plan = make_plan(ctx).with_artifact(image.NATIVE_ARTIFACT, b"\x7fELF")
    dest = dockerfile.write_context(image.bundle_context(plan), tmp_path / "bundle", plan.created)
    so = dest / ("files" + OFFICIAL_VLLM_ROOT) / "cumem_allocator.abi3.so"
    assert so.stat().st_mode & 0o777 == 0o755 and int(so.stat().st_mtime) == plan.created
    with pytest.raises(VerifyError, match="no content yet"):
        dockerfile.write_context(image.bundle_context(make_plan(ctx)), dest, 0)
    assert so.read_bytes() == b"\x7fELF"  # the failed write left the old context


# --- the command, with a fake engine ---------------------------------------------------


def test_dry_run_needs_no_daemon(ctx, monkeypatch, capsys):
    monkeypatch.setattr(containers_mod, "docker_engine", lambda: pytest.fail("a dry run asked for the daemon"))
    monkeypatch.chdir(ctx.config.base_dir)
    assert main(["image", "--dry-run", "-q", "--config", _config_file(ctx)]) == 0
    out = capsys.readouterr().out
    assert "FROM example/vllm-openai:v0.21.0" in out and "build_cumem_extension" in out
    assert "(built by Dockerfile.builder)" in out and "device_allocator/cumem.py" in out
    assert "manifest.json" in out


def _config_file(ctx: Context) -> str:
    path = Path(ctx.config.base_dir) / "test.yaml"
    text = (
        f"pin:\n  version: '0.21.0'\n  source: {ctx.config.pin.source}\nseries: {ctx.config.series}\n"
        "image:\n  base: example/vllm-openai:v0.21.0\n  tag: example/bundle:test\n"
    )
    path.write_text(text)
    return str(path)


def test_build_flow(ctx, engine, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH["SOURCE_DATE_EPOCH"])
    result = image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out", push=True)
    builds = [c for c in engine.calls if c[0] == "build"]
    assert [b[1].split(":")[0] for b in builds] == ["sm12x-bundle-builder", "example/bundle"]
    assert builds[0][2].splitlines()[-1].startswith("RUN cd /sm12x-build")
    built = engine.images["example/bundle:test"]
    so = built.files[OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so"]
    assert so.startswith(b"\x7fELF") and CPP_NEW.encode() in so
    assert built.files[OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py"] == CUMEM_NEW.encode()
    manifest = json.loads(built.files[image.DOC_DIR + "/manifest.json"])
    assert {f["sha256"] for f in manifest["files"]} == {sha(so), sha(CUMEM_NEW.encode())}
    record = manifest["native"][OFFICIAL_VLLM_ROOT + "/cumem_allocator.abi3.so"]
    assert record["built_on"] == "builder image " + engine.images[builds[0][1]].id
    assert record["builder_base"] == BASE_ID and record["links"] == ["libcuda.so.1"]
    assert record["requires"] == ["GLIBC_2.14"] and record["built_from"]["patches"] == ["native-fix"]
    assert built.labels["org.opencontainers.image.vendor"] == ""
    assert built.labels["maintainer"] == "upstream"
    assert engine.calls[-1] == ("push", "example/bundle:test")
    assert result.checked == 2 and result.imported == ()


def test_an_extension_that_does_not_link_libcuda_is_refused(ctx, engine, tmp_path):
    engine.readelf = b" 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]\n"
    with pytest.raises(CommandError, match="does not link libcuda.so.1"):
        image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    assert [c[1].split(":")[0] for c in engine.calls if c[0] == "build"] == ["sm12x-bundle-builder"]


def test_a_failed_check_is_a_verify_error(ctx, engine, tmp_path, monkeypatch):
    real_build = engine.build

    def build(context, dockerfile, tag, buildargs, progress):
        image_id = real_build(context, dockerfile, tag, buildargs, progress)
        engine.images[tag].problems = ["/x/cumem.py: does not compile: SyntaxError"]
        return image_id

    monkeypatch.setattr(engine, "build", build)
    with pytest.raises(VerifyError, match="does not compile"):
        image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")


def test_skewed_base_is_refused_before_any_build(ctx, engine, tmp_path):
    base = engine.images["example/vllm-openai:v0.21.0"]
    base.files[OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py"] = b"another release\n"
    # the base's own file is patched (the plan): the hunk does not apply there
    with pytest.raises(ApplyError, match="device_allocator/cumem.py: hunk #1"):
        image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    # the patch applies, but the file is not the pinned release's
    base.files[OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py"] = (CUMEM_OLD + "# another release\n").encode()
    base.id = "sha256:" + "c" * 64  # another image
    with pytest.raises(VerifyError, match="version skew in .*device_allocator/cumem.py"):
        image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    assert not [c for c in engine.calls if c[0] == "build"]
    assert not (tmp_path / "out").exists()


def test_missing_base_is_an_engine_error_and_nothing_is_built(ctx, engine, tmp_path):
    cfg = dataclasses.replace(ctx.config.image, base="example/nothing:1")
    with pytest.raises(EngineError, match="example/nothing:1 not found"):
        image.build_bundle(ctx, cfg, engine, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_base_digest_pins_the_reference(ctx, engine, tmp_path):
    digest = "sha256:" + "d" * 64
    cfg = dataclasses.replace(ctx.config.image, base="reg.example:5000/vllm:v1", base_digest=digest)
    assert image._reference(cfg) == f"reg.example:5000/vllm@{digest}"
    engine.images[f"reg.example:5000/vllm@{digest}"] = engine.images["example/vllm-openai:v0.21.0"]
    result = image.build_bundle(ctx, cfg, engine, tmp_path / "out")
    assert result.plan.labels["org.opencontainers.image.base.digest"] == digest
    assert result.plan.labels["org.opencontainers.image.base.name"] == "reg.example:5000/vllm:v1"


def test_base_digest_comes_from_the_repository_digest(ctx, engine, tmp_path):
    """A pulled base (RepoDigests): its manifest digest, its own repository's first, never the id."""
    base = engine.images["example/vllm-openai:v0.21.0"]
    base.repo_digests = [f"mirror.example/vllm@sha256:{'1' * 64}", f"example/vllm-openai@{BASE_DIGEST}"]
    result = image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    assert result.plan.labels["org.opencontainers.image.base.digest"] == BASE_DIGEST
    assert result.plan.base.digest_note is None


def test_base_digest_is_omitted_when_the_base_has_none(ctx, engine, tmp_path, capsys, monkeypatch):
    """A base built or loaded here has no RepoDigests: no label (an id is not a manifest digest), and why."""
    result = image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    labels = engine.images["example/bundle:test"].labels
    assert "org.opencontainers.image.base.digest" not in result.plan.labels
    assert BASE_ID not in labels.values()
    assert "has no repository digest" in result.plan.base.digest_note
    base = engine.images["example/vllm-openai:v0.21.0"]
    base.labels["org.opencontainers.image.base.digest"] = "upstream's base"  # inherited: cleared
    result = image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out2")
    assert result.plan.labels["org.opencontainers.image.base.digest"] == ""


def test_from_names_an_image_never_a_bare_id(ctx, engine, tmp_path):
    """BuildKit reads FROM sha256:<id> as docker.io/library/sha256:<id>: a local pin tag instead."""
    image.build_bundle(ctx, ctx.config.image, engine, tmp_path / "out")
    pin = "sm12x-bundle-pin:" + "b" * 64
    assert ("tag", BASE_ID, pin) in engine.calls
    froms = [line for c in engine.calls if c[0] == "build" for line in c[2].splitlines() if line.startswith("FROM")]
    assert froms == [f"FROM {pin}", f"FROM {pin}"]


# --- real builds on stand-in images (a Docker daemon) -----------------------------------


@pytest.fixture(scope="module")
def pinned_ctx(default_context) -> Context:
    return default_context


def build_cli(base: str, tag: str, out: Path, *extra: str) -> int:
    return main(["image", "-q", "--base", base, "--tag", tag, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def bundle(daemon, standin_official, tmp_path_factory):
    """One real build (through the command) on the official-root stand-in."""
    out = tmp_path_factory.mktemp("image")
    assert build_cli(standin_official.ref, "sm12x-test/bundle:a", out / "a") == 0
    return out / "a", "sm12x-test/bundle:a"


@pytest.mark.docker
def test_bundle_files_match_the_manifest_and_the_pinned_series(daemon, bundle, series, pinned_source):
    out, tag = bundle
    manifest = json.loads((out / "bundle/files" / image.DOC_DIR.lstrip("/") / "manifest.json").read_text())
    assert manifest["vllm_root"] == OFFICIAL_VLLM_ROOT
    assert manifest["versions"]["vllm"] == "0.21.0"
    _, changes = patched_files(series, pinned_source)
    inside = daemon.read_files(tag, [f["container_path"] for f in manifest["files"]])
    for f in manifest["files"]:
        data = inside[f["container_path"]]
        assert data is not None and sha(data) == f["sha256"], f["container_path"]
        rel = "vllm" + f["container_path"][len(OFFICIAL_VLLM_ROOT):]
        if rel.endswith(".py"):
            assert data == changes[rel].to_bytes()
            original = pinned_source.root / rel
            assert f["pre_image_sha256"] == (sha(original.read_bytes()) if original.exists() else None)
        else:
            assert data.startswith(b"\x7fELF") and f["patches"] == native_fixes("0.21.0")


@pytest.mark.docker
def test_bundle_doc_folder_and_stale_bytecode(daemon, bundle, series):
    out, tag = bundle
    doc = image.DOC_DIR
    names = [series.file.name] + [p.file.name for p in series.patches] + ["manifest.json"]
    inside = daemon.read_files(tag, [f"{doc}/{n}" for n in names])
    assert inside[f"{doc}/series"] == series.file.read_bytes()
    for p in series.patches:
        assert inside[f"{doc}/{p.file.name}"] == p.text.encode()
    local = out / "bundle/files" / doc.lstrip("/") / "manifest.json"
    assert inside[f"{doc}/manifest.json"] == local.read_bytes()
    # the stand-in compiled device_allocator/: cumem.py's stale .pyc is gone, its neighbour stays
    pycache = OFFICIAL_VLLM_ROOT + "/device_allocator/__pycache__/"
    left = daemon.read_files(tag, [pycache + "cumem.cpython-311.pyc", pycache + "__init__.cpython-311.pyc"])
    assert left[pycache + "cumem.cpython-311.pyc"] is None
    assert left[pycache + "__init__.cpython-311.pyc"] is not None


@pytest.mark.docker
def test_bundle_labels(daemon, bundle, standin_official, series):
    _, tag = bundle
    labels = daemon.image_labels(tag)
    oci = "org.opencontainers.image."
    assert labels[oci + "base.name"] == standin_official.ref
    # a stand-in is built here: no RepoDigests, so no base.digest (never the local id)
    assert oci + "base.digest" not in labels
    assert labels[oci + "revision"] == series.sha256
    assert labels[oci + "source"] == "https://example.invalid/sm12x-bundle"
    assert labels[oci + "version"] == f"0.21.0+sm12x.{series.sha256[:12]}"
    assert labels[oci + "created"].endswith("Z")
    project = json.loads(labels["org.sm12x-bundle.bundle"])
    assert project == {
        "patches": list(series.ids),
        "pin": {"version": "0.21.0", "sha256": "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"},
        "series_sha256": series.sha256,
    }


# Debian's docker CLI (20.10) builds through the daemon's BuildKit with DOCKER_BUILDKIT=1;
# a newer CLI elsewhere on PATH may lack the buildx plugin, so this one is named.
DEBIAN_DOCKER_CLI = Path("/usr/bin/docker")


@pytest.mark.docker
def test_rendered_contexts_build_with_buildkit_too(daemon, bundle, tmp_path):
    """The bundle fixture built both contexts with the classic builder (the SDK); BuildKit
    (Docker's default builder since 23.0) must build the same files, FROM and all."""
    if not DEBIAN_DOCKER_CLI.is_file():
        unavailable(f"{DEBIAN_DOCKER_CLI} (Debian's docker.io CLI) is not installed")
    out, tag = bundle
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    for name in ("builder", "bundle"):
        # --network none: the test daemon has no bridge (.ci/dockerd.sh), and no step needs one
        argv = [str(DEBIAN_DOCKER_CLI), "build", "--progress", "plain", "--network", "none",
                "-t", f"sm12x-test/buildkit-{name}:1", "."]
        proc = subprocess.run(argv, cwd=out / name, env=env, capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "[internal] load build definition" in proc.stderr  # BuildKit's output, not the classic builder's
    assert daemon.image_labels("sm12x-test/buildkit-bundle:1") == daemon.image_labels(tag)


@pytest.mark.docker
def test_same_inputs_same_files_and_labels(daemon, bundle, standin_official, tmp_path, capsys):
    out_a, tag_a = bundle
    assert build_cli(standin_official.ref, "sm12x-test/bundle:b", tmp_path / "b") == 0
    # the stand-in has no RepoDigests: the output says why base.digest is omitted
    assert "has no repository digest" in capsys.readouterr().out
    assert daemon.image_labels("sm12x-test/bundle:b") == daemon.image_labels(tag_a)
    manifest = "bundle/files" + image.DOC_DIR + "/manifest.json"
    a, b = (json.loads((out / manifest).read_text()) for out in (out_a, tmp_path / "b"))
    assert (a.pop("target"), b.pop("target")) == (tag_a, "sm12x-test/bundle:b")  # the only difference
    assert a == b


@pytest.mark.docker
def test_a_base_of_a_release_without_a_lane_is_refused_naming_the_lanes(daemon, standin_skew, tmp_path, capsys):
    code = build_cli(standin_skew.ref, "sm12x-test/bundle:skew", tmp_path / "skew")
    err = capsys.readouterr().err
    assert code == SeriesError.exit_code
    assert f"image {standin_skew.ref} carries vLLM 0.26.0, and no lane is for it (lanes: 0.21.0, 0.33.0)" in err
    with pytest.raises(EngineError, match="not found"):
        daemon.image_id("sm12x-test/bundle:skew")
    assert not (tmp_path / "skew").exists()


@pytest.mark.docker
def test_a_0_33_0_base_is_planned_with_the_0_33_0_lane(daemon, standin_lane2, pinned_ctx):
    """The base's own vLLM version selects the lane: its files, native build and labels."""
    cfg = dataclasses.replace(pinned_ctx.config.image, base=standin_lane2.ref)
    plan = image.plan_from_base(pinned_ctx, cfg, daemon)
    lane = pinned_ctx.lane("0.33.0")
    assert plan.target.lane is lane and plan.series_sha256 == lane.series.sha256
    assert plan.pin["version"] == "0.33.0" and plan.side.versions["vllm"] == "0.33.0"
    assert plan.labels["org.opencontainers.image.version"].startswith("0.33.0+sm12x.")
    assert {i for f in plan.files for i in f.patches} <= set(lane.series.ids)
    assert plan.doc["series"] == lane.series.file.read_bytes()
    if plan.native is not None:  # built in the base itself, from 0.33.0's patched sources
        assert plan.builder.base == daemon.image_id(standin_lane2.ref)
        assert plan.native.built_from["vllm"] == "0.33.0"


@pytest.mark.docker
def test_opt_root_is_found_and_planned(daemon, standin_opt, pinned_ctx):
    cfg = dataclasses.replace(pinned_ctx.config.image, base=standin_opt.ref)
    plan = image.plan_from_base(pinned_ctx, cfg, daemon)
    assert plan.side.root == "/opt/vllm/vllm"
    assert all(f.container_path.startswith("/opt/vllm/vllm/") for f in plan.files)
    assert plan.side.versions["vllm"] == "0.21.0"  # from vllm/_version.py: no metadata there


@pytest.mark.docker
def test_base_without_vllm_is_refused(daemon, standin_novllm, tmp_path, capsys):
    assert build_cli(standin_novllm.ref, "sm12x-test/bundle:none", tmp_path / "none") == EngineError.exit_code
    assert "holds no vLLM" in capsys.readouterr().err


@pytest.mark.docker
def test_missing_base_image(daemon, tmp_path, capsys):
    assert build_cli("sm12x-test/no-such-image:1", "sm12x-test/bundle:x", tmp_path / "x") == EngineError.exit_code
    assert "sm12x-test/no-such-image:1 not found" in capsys.readouterr().err


@pytest.mark.docker
def test_builder_failure_is_a_command_error(daemon, standin_base, tmp_path):
    builder = native_build.BuilderPlan(daemon.image_id(standin_base), {"csrc/cumem_allocator.cpp": b"not C++\n"})
    with pytest.raises(CommandError, match="cumem_allocator.cpp"):
        native_build.build_in_builder(daemon, builder, tmp_path / "builder", Progress.quiet())
