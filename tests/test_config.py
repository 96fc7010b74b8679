from pathlib import Path

import pytest

from sm12x_bundle.source.pin import known_sha256

from sm12x_bundle import config as config_mod
from sm12x_bundle import values
from sm12x_bundle.errors import ConfigError


def parse(text: str):
    return config_mod.parse(text, "cfg.yaml", Path("/base"))


def test_embedded_default_is_the_pinned_release():
    cfg = config_mod.parse(config_mod.default_text(), "<embedded default>", Path("."))
    assert cfg.pin.version == "0.21.0"  # the first lane (tests/test_lanes.py checks both)
    assert cfg.pin.sha256 is None  # the sha256 data/releases.json records, the one place a pin lives
    assert known_sha256("0.21.0") == "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"
    assert cfg.check.fuzz == 0
    assert cfg.targets[0].name == "vllm-openai-v0.21.0"


def test_unknown_key_names_file_line_and_nearest_key():
    with pytest.raises(ConfigError) as exc:
        parse("pin:\n  version: '0.21.0'\n  sha265: abc\n")
    assert str(exc.value) == "cfg.yaml:3: unknown key 'pin.sha265' (did you mean 'sha256'?)"


def test_unknown_top_level_key_suggests():
    with pytest.raises(ConfigError, match=r"cfg.yaml:1: unknown key 'targts' \(did you mean 'targets'\?\)"):
        parse("targts: []\n")


def test_wrong_type_is_located():
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: check.fuzz must be int, not str"):
        parse("check:\n  fuzz: lots\n")


def test_unquoted_version_number_is_caught():
    with pytest.raises(ConfigError, match="pin.version must be a string: quote it"):
        parse("pin:\n  version: 0.21\n")


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match="check.fuzz must be int, not bool"):
        parse("check:\n  fuzz: true\n")


def test_duplicate_key_rejected():
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: duplicate key 'pin'"):
        parse("pin: {}\npin: {}\n")


def test_malformed_yaml_is_located():
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: not valid YAML"):
        parse("pin: b\n  c: d\n")


def test_yaml_is_loaded_safely():
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse("pin: !!python/object/apply:os.system ['true']\n")


def test_missing_required_field_in_list_item():
    with pytest.raises(ConfigError, match=r"cfg.yaml:2: targets\[0\] needs image"):
        parse("targets:\n  - name: a\n")


def test_job_must_name_a_known_target():
    text = "targets:\n  - {name: a, image: x}\njobs:\n  - {name: j, model: m, target: b}\n"
    with pytest.raises(ConfigError, match="names target 'b'"):
        parse(text)


def test_paths_resolve_against_the_config_file(tmp_path):
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "series").write_text("# nothing carried\n")
    cfg = config_mod.parse("series: patches/series\n", "cfg.yaml", tmp_path)
    assert cfg.resolve("patches/series") == tmp_path / "patches" / "series"
    assert cfg.series_path(cfg.lanes[0]) == tmp_path / "patches" / "series"
    assert cfg.resolve("/abs") == Path("/abs")


def test_local_file_replaces_default(tmp_path):
    (tmp_path / "sm12x-bundle.yaml").write_text("pin:\n  version: '0.33.0'\n")
    cfg = config_mod.load(cwd=tmp_path)
    assert cfg.pin.version == "0.33.0"
    assert [lane.version for lane in cfg.lanes] == ["0.33.0"]
    assert cfg.origin.endswith("sm12x-bundle.yaml")


def test_unreadable_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        config_mod.load(tmp_path / "absent.yaml")


def test_a_value_is_checked_at_load_and_named_by_file_line_key():
    text = "targets:\n  - {name: a, image: x}\njobs:\n  - name: j\n    model: m\n    target: a\n    port: 99999\n"
    with pytest.raises(ConfigError) as exc:
        parse(text)
    assert str(exc.value) == "cfg.yaml:7: jobs[0].port: port must be in 1-65535, not 99999"


def test_a_key_left_to_its_default_is_named_on_its_item_line():
    # healthy_deadline_s keeps its default (1800); the job's own line is the place to add it.
    text = "targets:\n  - {name: a, image: x}\njobs:\n  - name: j\n    model: m\n    target: a\n    load_time_s: 2000\n"
    with pytest.raises(ConfigError, match=r"^cfg.yaml:4: jobs\[0\].healthy_deadline_s: healthy_deadline_s \(1800\) must exceed load_time_s \(2000\)"):
        parse(text)


def test_a_mapping_key_is_named_on_its_own_line():
    text = "targets:\n  - {name: a, image: x}\njobs:\n  - name: j\n    model: m\n    target: a\n    env:\n      OK: '1'\n      2BAD: '1'\n"
    with pytest.raises(ConfigError, match=r"^cfg.yaml:9: jobs\[0\].env.2BAD: env key '2BAD' is not a valid variable name"):
        parse(text)


SHARED_JOB = (
    "targets:\n  - {name: a, image: x}\njobs:\n  - name: j\n    model: m\n    target: a\n"
    "    gpu_allocation: shared\n    gpu_ids: ['0']\n"
)


def test_a_job_has_no_gate_and_no_host_ram_check_unless_it_asks():
    (job,) = parse(SHARED_JOB).jobs
    assert (job.gate, job.gate_tool_dir, job.gate_time_s, job.host_ram_gib) == ("none", "/opt/sm12x-bundle/tool", 600, None)
    (gated,) = parse(SHARED_JOB + "    gate: allocator\n    gate_tool_dir: /srv/sm12x-bundle\n    host_ram_gib: 512\n").jobs
    assert (gated.gate, gated.gate_tool_dir, gated.host_ram_gib) == ("allocator", "/srv/sm12x-bundle", 512)


def test_a_gate_with_device_gpus_is_refused_with_the_reason():
    text = "targets:\n  - {name: a, image: x}\njobs:\n  - name: j\n    model: m\n    target: a\n    gate: engine\n"
    with pytest.raises(ConfigError) as exc:
        parse(text)
    assert str(exc.value) == (
        "cfg.yaml:7: jobs[0].gate: a gate needs gpu_allocation 'shared': with 'device', Nomad reserves GPUs for each "
        "task on its own, so the gate would get GPUs beside vLLM's, not vLLM's, and Nomad's docs do not promise that a "
        "finished prestart task's GPUs go to the main task (hashicorp/nomad#9725; nomad/README.md)"
    )


def test_a_gate_takes_its_time_out_of_the_healthy_deadline():
    with pytest.raises(ConfigError, match=r"^cfg.yaml:4: jobs\[0\].healthy_deadline_s: healthy_deadline_s \(1800\) must exceed "
                       r"load_time_s \(900\) \+ gate_time_s \(901\): the gate runs inside the allocation before the model loads"):
        parse(SHARED_JOB + "    gate: engine\n    gate_time_s: 901\n")
    assert parse(SHARED_JOB + "    gate: engine\n    gate_time_s: 899\n").jobs[0].gate == "engine"


@pytest.mark.parametrize("value, problem", [
    ("0.21.0", None), ("0.10.1.1", None), ("0.11.0rc1", None), ("0.9.2.post1", None),
    ("", "must be a vLLM release version"), ("v0.21.0", "must be a vLLM release version"), ("0.21.0 ", "must be"),
])
def test_versions_are_release_numbers(value, problem):
    got = values.version_problem(value)
    assert got is None if problem is None else problem in got


@pytest.mark.parametrize("ref, ok", [
    ("vllm/vllm-openai:v0.21.0", True), ("reg.example:5000/vllm:v1", True), ("glm:nvfp4", True),
    ("ubuntu@sha256:" + "a" * 64, True), ("Bad Image", False), ("vllm/vllm-openai:", False), ("UPPER/case", False),
])
def test_image_references(ref, ok):
    assert (values.image_problem(ref) is None) is ok


# --- what a config file may hold ----------------------------------------------------


def _bomb(levels: int) -> str:
    """``levels`` lines, each a list naming the line before it nine times: 9**levels values."""
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_anything_expands():
    # Four levels (6,561 values) here, so that without the bound this fails instead of
    # eating the machine; seven levels, as a real process, are in test_bad_input.py.
    with pytest.raises(ConfigError) as exc:
        parse(_bomb(4))
    assert str(exc.value) == ("cfg.yaml:1: anchors and aliases are not allowed in a config (found &a0): "
                              "write each value where it is used")


def test_an_alias_is_refused_on_its_own_line():
    with pytest.raises(ConfigError, match=r"^cfg.yaml:3: anchors and aliases are not allowed in a config \(found \*x\)"):
        parse("check:\n  fuzz: 0\noutput: *x\n")


@pytest.mark.parametrize("text", ["[" * 50_000 + "]" * 50_000, "a:\n" + "".join(" " * n + f"k{n}:\n" for n in range(1, 40))],
                         ids=["50000-lists", "40-mappings"])
def test_deep_nesting_is_refused_not_a_stack_overflow(text):
    with pytest.raises(ConfigError, match=r"^cfg.yaml:\d+: nested more than 32 levels deep: refused$"):
        parse(text)


def test_the_depth_bound_leaves_room():
    # 31 nested mappings under output: refused as an unknown key, not for its depth.
    text = "output:\n" + "".join("  " * n + f"k{n}:\n" for n in range(1, 31)) + "  " * 31 + "leaf: 1\n"
    with pytest.raises(ConfigError, match="unknown key 'output.k1'"):
        parse(text)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "{}\n", "---\n", "~\n", "null\n"])
def test_a_file_without_settings_is_refused(text):
    """An operator who passes a file means something by it: an empty one is not the default."""
    with pytest.raises(ConfigError) as exc:
        parse(text)
    assert str(exc.value).startswith("cfg.yaml:1: the file holds no settings (it is empty, only comments, or {}): ")


def test_a_local_config_without_settings_is_refused_too(tmp_path):
    (tmp_path / "sm12x-bundle.yaml").write_text("# to do\n")
    with pytest.raises(ConfigError, match="sm12x-bundle.yaml:1: the file holds no settings"):
        config_mod.load(cwd=tmp_path)


def test_a_config_is_read_up_to_its_bound_only(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "MAX_BYTES", 64)
    (tmp_path / "c.yaml").write_text("check:\n  fuzz: 0\n" + "#" * 64 + "\n")
    with pytest.raises(ConfigError, match=r"^config .*c.yaml is larger than 64 bytes: refused$"):
        config_mod.load(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("check:\n  fuzz: 0\n")
    assert config_mod.load(tmp_path / "c.yaml").check.fuzz == 0


def test_a_config_that_is_not_utf8_names_the_file_and_line(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"check:\n  fuzz: 0\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml is not UTF-8 text \(line 3, byte 22: 0xe9\)$"):
        config_mod.load(tmp_path / "c.yaml")
