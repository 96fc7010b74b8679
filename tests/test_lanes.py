"""Lanes: several pinned releases, each with its own series (config/, context.py,
series/lane.py, checks/, the check and apply commands, build's tree steps)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tools.patchkit import make_patch, write_series
from sm12x_bundle import config as config_mod
from sm12x_bundle.cli import main
from sm12x_bundle.context import Context
from sm12x_bundle.errors import ConfigError
from sm12x_bundle.progress import Progress
from sm12x_bundle.series.lane import nearest_at_or_below, version_key

SHA_21 = "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"
SHA_33 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
TWO_LANES = f"""\
lanes:
  - version: "0.21.0"
    sha256: {SHA_21}
  - version: "0.33.0"
    sha256: {SHA_33}
"""


def parse(text: str, base: Path = Path("/base")):
    return config_mod.parse(text, "cfg.yaml", base)


# --- configuration -----------------------------------------------------------


def test_the_embedded_default_has_both_lanes_with_their_shipped_series():
    cfg = config_mod.parse(config_mod.default_text(), "<embedded default>", Path("."))
    # every shipped series is a lane, pinned by data/releases.json (the config repeats no sha256)
    lanes = Context(cfg, Progress.quiet()).lanes
    assert [(lane.version, lane.pin.sha256) for lane in lanes] == [("0.21.0", SHA_21), ("0.33.0", SHA_33)]
    assert [cfg.series_path(lane).relative_to(cfg.series_path(lane).parents[2]).as_posix() for lane in cfg.lanes] == [
        "patches/0.21.0/series",
        "patches/0.33.0/series",
    ]
    assert cfg.pin.version == "0.21.0"  # the one-lane name repeats the first lane


def test_lanes_parse_with_their_own_series_and_source(tmp_path):
    write_series(tmp_path / "mine", {})
    cfg = parse(TWO_LANES + "    series: mine/series\n    source: src/vllm-0.33.0.tar.gz\n", tmp_path)
    first, second = cfg.lanes
    assert (first.series, second.series, second.source) == (None, "mine/series", "src/vllm-0.33.0.tar.gz")
    assert cfg.series_path(second) == tmp_path / "mine" / "series"


def test_the_pin_form_is_one_lane():
    cfg = parse('pin:\n  version: "0.33.0"\n')
    assert [(lane.version, lane.sha256, lane.series) for lane in cfg.lanes] == [("0.33.0", None, None)]


@pytest.mark.parametrize(
    "text, message",
    [
        (TWO_LANES.replace('"0.33.0"', '"0.21.0"'),
         "cfg.yaml:4: lanes[1].version: lane versions must be unique: '0.21.0' is already a lane"),
        (TWO_LANES.replace(SHA_33, "f4c3"),
         "cfg.yaml:5: lanes[1].sha256: must be 64 lowercase hex digits (a sha256), not 'f4c3'"),
        (TWO_LANES + "    series: absent/series\n",
         "cfg.yaml:6: lanes[1].series: the series file '/base/absent/series' does not exist"),
        ('pin:\n  version: "0.21.0"\n' + TWO_LANES,
         "cfg.yaml:1: pin: 'pin:' is the one-lane form; with 'lanes:' give each lane's version, sha256 and "
         "series there"),
        (TWO_LANES + "series: patches/series\n",
         "cfg.yaml:6: series: 'series:' is the one-lane form; with 'lanes:' give each lane's version, sha256 "
         "and series there"),
        ("lanes: []\n", "cfg.yaml:1: lanes: must list at least one lane (version, sha256, and optionally series "
         "and source)"),
        ('lanes:\n  - version: "0.26.0"\n',
         "cfg.yaml:2: lanes[0].version: no series is shipped for vLLM 0.26.0 (shipped lanes: 0.21.0, 0.33.0); "
         "give 'lanes[0].series'"),
        ("lanes:\n  - version: 0.33\n", "cfg.yaml:2: lanes[0].version must be a string: quote it"),
        ('lanes:\n  - version: "0.33.0"\n    sha265: x\n',
         "cfg.yaml:3: unknown key 'lanes[0].sha265' (did you mean 'sha256'?)"),
        (TWO_LANES + 'check:\n  versions: ["0.20.0"]\n',
         "cfg.yaml:7: check.versions[0]: 0.20.0 is below every lane (0.21.0, 0.33.0): no lane's series is "
         "written for it"),
        ('pin:\n  version: "0.26.0"\n',
         "cfg.yaml:2: pin.version: no series is shipped for vLLM 0.26.0 (shipped lanes: 0.21.0, 0.33.0); "
         "give 'series'"),
    ],
    ids=["duplicate", "bad-sha256", "series-absent", "with-pin", "with-series", "empty", "no-shipped-series",
         "unquoted", "typo", "check-below-every-lane", "pin-without-series"],
)
def test_a_bad_lane_is_named_by_file_line_and_key(text, message):
    with pytest.raises(ConfigError) as exc:
        parse(text)
    assert str(exc.value).startswith(message)


def test_a_bad_lane_exits_3_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "sm12x-bundle.yaml").write_text(TWO_LANES.replace('"0.33.0"', '"0.21.0"'))
    assert main(["check", "-q"]) == 3
    assert "sm12x-bundle.yaml:4: lanes[1].version: lane versions must be unique" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm12x-bundle.yaml"]


# --- choosing a lane ----------------------------------------------------------


def test_versions_sort_as_releases():
    ordered = ["0.9.0", "0.21.0", "0.21.1", "0.33.0.dev1", "0.33.0a1", "0.33.0rc1", "0.33.0", "0.33.0.post1", "0.34"]
    assert sorted(reversed(ordered), key=version_key) == ordered
    assert version_key("0.33") == version_key("0.33.0")


@pytest.mark.parametrize(
    "release, lane",
    [("0.20.9", None), ("0.21.0", "0.21.0"), ("0.26.0", "0.21.0"), ("0.33.0rc1", "0.21.0"),
     ("0.33.0", "0.33.0"), ("0.33.1", "0.33.0"), ("1.0.0", "0.33.0")],
)
def test_the_lane_for_a_release_is_the_nearest_pin_at_or_below(release, lane):
    ctx = Context(parse(TWO_LANES), Progress.quiet())
    chosen = ctx.lane_for(release)
    assert (chosen.version if chosen else None) == lane
    assert nearest_at_or_below(["0.33.0", "0.21.0"], release) == lane


def test_a_lane_is_named_exactly():
    ctx = Context(parse(TWO_LANES), Progress.quiet())
    assert ctx.lane("0.33.0").pin.sha256 == SHA_33
    assert ctx.lane("0.26.0") is None
    assert ctx.lane_versions == "0.21.0, 0.33.0"
    assert [lane.series.file.parent.name for lane in ctx.lanes] == ["0.21.0", "0.33.0"]


# --- check and apply on two small local lanes ---------------------------------

BODY = "".join(f"line {i}\n" for i in range(1, 31))


def _edit(old: str, new: str, **headers: str) -> str:
    return make_patch({"vllm/a.py": (BODY, BODY.replace(old, new))}, **headers)


@pytest.fixture
def lanes(tmp_path, monkeypatch):
    """Two lanes on local trees: 0.21.0 carries fixes 'one', 'two' and 'three'; 0.33.0's
    release already has 'one' (the same change) and 'two' (in its own words, seen by a
    probe), and its series carries 'four' only, so 'three' is missing there (and 'four',
    written for 0.33.0 only, from lane 0.21.0)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    old, new = tmp_path / "src-0.21.0", tmp_path / "src-0.33.0"
    for tree, version, body in ((old, "0.21.0", BODY), (new, "0.33.0", BODY.replace("line 3\n", "three\n"))):
        (tree / "vllm").mkdir(parents=True)
        (tree / "vllm" / "__init__.py").write_text("")
        (tree / "vllm" / "a.py").write_text(body)
        (tree / "vllm" / "b.py").write_text("def fixed():\n    return \"upstream's fix\"\n" if version == "0.33.0" else "")
        (tree / "PKG-INFO").write_text(f"Version: {version}\n")
    write_series(tmp_path / "patches" / "0.21.0", {
        "0001-one.patch": _edit("line 3\n", "three\n"),
        "0002-two.patch": _edit("line 10\n", "ten\n", Sm12x_Probe="vllm/b.py::fixed ~ upstream's fix"),
        "0003-three.patch": _edit("line 20\n", "twenty\n"),
    })
    write_series(tmp_path / "patches" / "0.33.0", {"0001-four.patch": _edit("line 25\n", "twenty-five\n")})
    (tmp_path / "sm12x-bundle.yaml").write_text(
        "lanes:\n"
        f"  - {{version: '0.21.0', source: {old}, series: patches/0.21.0/series}}\n"
        f"  - {{version: '0.33.0', source: {new}, series: patches/0.33.0/series}}\n"
    )
    return tmp_path


def test_check_reports_each_lane_at_its_pin_with_the_fixes_it_does_not_carry(lanes, capsys):
    assert main(["check", "-q"]) == 20  # 'three' is missing from lane 0.33.0, 'four' from 0.21.0
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [
        ["0.21.0", "0.21.0", "one", "applies"],
        ["0.21.0", "0.21.0", "two", "applies"],
        ["0.21.0", "0.21.0", "three", "applies"],
        ["0.21.0", "0.21.0", "four", "not carried, and not landed upstream: this lane lacks the fix"],
        ["0.33.0", "0.33.0", "four", "applies"],
        ["0.33.0", "0.33.0", "one", "not carried: landed upstream (reverse-apply)"],
        ["0.33.0", "0.33.0", "two", "not carried: landed upstream (probe)"],
        ["0.33.0", "0.33.0", "three", "not carried, and not landed upstream: this lane lacks the fix"],
    ]


def test_a_dropped_fix_that_landed_does_not_make_the_check_exit_10(lanes, capsys):
    write_series(lanes / "patches" / "0.21.0", {
        "0001-one.patch": _edit("line 3\n", "three\n"),
        "0002-two.patch": _edit("line 10\n", "ten\n", Sm12x_Probe="vllm/b.py::fixed ~ upstream's fix"),
    })
    write_series(lanes / "patches" / "0.33.0", {})  # carries nothing: both fixes landed in 0.33.0
    assert main(["check", "-q"]) == 0
    assert "not carried: landed upstream" in capsys.readouterr().out


def test_json_and_junit_name_the_lane(lanes, capsys, tmp_path):
    assert main(["check", "-q", "--json", "--junit", str(tmp_path / "r.xml")]) == 20
    entries = json.loads(capsys.readouterr().out)
    assert [(e["lane"], e["version"], e["result"]) for e in entries] == [
        ("0.21.0", "0.21.0", "missing a fix"),
        ("0.33.0", "0.33.0", "missing a fix"),
    ]
    carried = {p["patch"]: (p["carried"], p["outcome"], p["landed_by"]) for p in entries[1]["patches"]}
    assert carried == {
        "four": (True, "applies", None),
        "one": (False, "not carried", "reverse-apply"),
        "two": (False, "not carried", "probe"),
        "three": (False, "not carried", None),
    }
    suites = ET.parse(tmp_path / "r.xml").getroot().findall("testsuite")
    assert [(s.get("name"), s.get("tests"), s.get("failures"), s.get("skipped")) for s in suites] == [
        ("lane-0.21.0.vllm-0.21.0", "4", "1", "0"),
        ("lane-0.33.0.vllm-0.33.0", "4", "1", "2"),
    ]
    [failure] = suites[1].findall("testcase/failure")
    assert "lacks the fix" in failure.get("message")


def test_vllm_picks_the_nearest_lane_below_and_says_so(lanes, capsys):
    cfg = lanes / "sm12x-bundle.yaml"
    cfg.write_text(cfg.read_text() + f"  - {{version: '0.30.0', index_url: {(lanes / 'no-index').as_uri()}, "
                   "series: patches/0.33.0/series}\n")
    assert main(["check", "--vllm", "0.33.0", "--vllm", "0.32.0"]) == 4  # 0.32.0: no index to fetch it from
    out, err = capsys.readouterr()
    assert "check: vLLM 0.33.0 with lane 0.33.0 (the nearest lane at or below 0.33.0)" in err
    assert "check: vLLM 0.32.0 with lane 0.30.0 (the nearest lane at or below 0.32.0)" in err
    assert "0.30.0  0.32.0  -      could not run" in out


def test_lane_names_the_series_checked_against_a_release(lanes, capsys):
    assert main(["check", "--lane", "0.21.0", "--vllm", "0.33.0"]) == 20
    out, err = capsys.readouterr()
    assert "check: vLLM 0.33.0 with lane 0.21.0 (named by --lane)" in err
    assert "0.21.0  0.33.0  one    landed upstream (reverse-apply)" in out
    assert "0.21.0  0.33.0  four   not carried, and not landed upstream" in out


def test_a_release_below_every_lane_is_refused_and_nothing_fetched(lanes, capsys):
    assert main(["check", "-q", "--vllm", "0.20.0"]) == 2
    err = capsys.readouterr().err
    assert err == ("sm12x-bundle: error: --vllm 0.20.0 is below every lane (the lanes: 0.21.0, 0.33.0), so no "
                   "series is written for it: name one with --lane\n")
    assert not (lanes / "cache").exists()


def test_an_unknown_lane_is_refused(lanes, capsys):
    assert main(["check", "-q", "--lane", "0.26.0"]) == 2
    assert "--lane 0.26.0: the configuration has no such lane (its lanes: 0.21.0, 0.33.0)" in capsys.readouterr().err
    assert main(["apply", "-q", "--lane", "0.26.0", "--out", "tree"]) == 2
    assert not (lanes / "tree").exists()


def test_apply_writes_the_first_lane_or_the_one_named(lanes):
    assert main(["apply", "-q", "--out", "first"]) == 0
    assert (lanes / "first" / "vllm" / "a.py").read_text().splitlines()[19] == "twenty"
    assert main(["apply", "-q", "--lane", "0.33.0", "--out", "second"]) == 0
    lines = (lanes / "second" / "vllm" / "a.py").read_text().splitlines()
    assert (lines[19], lines[24]) == ("line 20", "twenty-five")


def test_build_plans_and_guards_one_tree_per_lane(lanes, capsys):
    assert main(["build", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3. tree 0.21.0    -> build/vllm-0.21.0-sm12x" in out and "4. tree 0.33.0    -> build/vllm-0.33.0-sm12x" in out
    foreign = lanes / "build" / "vllm-0.33.0-sm12x"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine\n")
    assert main(["build", "-q"]) == 11  # refused before anything is fetched or written
    assert not (lanes / "build" / "vllm-0.21.0-sm12x").exists()


# --- a fix partly landed upstream: its probes disagree -------------------------------

PROBES = "vllm/b.py::fixed ~ upstream's fix\nvllm/b.py::sleep ~ synchronize"
PARTLY = "partly landed upstream: vllm/b.py::fixed; not landed: vllm/b.py::sleep"


def test_a_conflict_whose_fix_partly_landed_says_which_part(lanes, capsys, tmp_path):
    """0.33.0's b.py has fixed() (one probe matches) but no sleep() (the other does not);
    the patch's context moved, so it conflicts: the row says both, the exit stays 20."""
    write_series(lanes / "patches" / "0.21.0", {"0001-partial.patch": _edit("line 4\n", "four\n", Sm12x_Probe=PROBES)})
    write_series(lanes / "patches" / "0.33.0", {})
    assert main(["check", "-q", "--lane", "0.21.0", "--vllm", "0.33.0", "--json", "--junit", str(tmp_path / "r.xml")]) == 20
    [entry] = json.loads(capsys.readouterr().out)
    [patch] = entry["patches"]
    assert (patch["outcome"], patch["landed_by"], patch["partly_landed"]) == (
        "conflict", None, {"landed": ["vllm/b.py::fixed"], "not_landed": ["vllm/b.py::sleep"]})
    assert patch["probes"] == [{"probe": "vllm/b.py::fixed", "matches": True},
                               {"probe": "vllm/b.py::sleep", "matches": False}]
    [failure] = ET.parse(tmp_path / "r.xml").getroot().findall("testsuite/testcase/failure")
    assert failure.get("message") == "conflict: vllm/a.py hunk #1 (line 1); " + PARTLY
    assert main(["check", "-q", "--lane", "0.21.0", "--vllm", "0.33.0"]) == 20
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split(None, 3)[3] == "conflict: vllm/a.py hunk #1 (line 1); " + PARTLY


def test_a_fix_not_carried_and_partly_landed_says_which_part(lanes, capsys, tmp_path):
    write_series(lanes / "patches" / "0.21.0", {"0001-partial.patch": _edit("line 4\n", "four\n", Sm12x_Probe=PROBES)})
    write_series(lanes / "patches" / "0.33.0", {})
    assert main(["check", "-q", "--lane", "0.33.0", "--junit", str(tmp_path / "r.xml")]) == 20
    row = capsys.readouterr().out.splitlines()[2].split(None, 3)
    assert row == ["0.33.0", "0.33.0", "partial",
                   "not carried, and not wholly landed upstream: this lane lacks the fix; " + PARTLY]
    [failure] = ET.parse(tmp_path / "r.xml").getroot().findall("testsuite/testcase/failure")
    assert failure.get("message").endswith(PARTLY)


def test_a_patch_that_applies_where_its_fix_partly_landed_says_so_and_passes(lanes, capsys, tmp_path):
    """The lane carries the part that did not land (as 0.33.0 carries sleep()'s synchronize)."""
    body = BODY.replace("line 3\n", "three\n")
    write_series(lanes / "patches" / "0.33.0", {
        "0001-partial.patch": make_patch({"vllm/a.py": (body, body.replace("line 30\n", "thirty\n"))}, Sm12x_Probe=PROBES),
    })
    write_series(lanes / "patches" / "0.21.0", {})
    assert main(["check", "-q", "--lane", "0.33.0", "--json", "--junit", str(tmp_path / "r.xml")]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert [(p["outcome"], p["partly_landed"]) for p in entry["patches"]] == [
        ("applies", {"landed": ["vllm/b.py::fixed"], "not_landed": ["vllm/b.py::sleep"]})]
    [case] = ET.parse(tmp_path / "r.xml").getroot().findall("testsuite/testcase")
    assert (case.find("failure"), case.findtext("system-out")) == (None, "applies; " + PARTLY)


def test_probes_that_agree_add_nothing(lanes, capsys):
    assert main(["check", "-q", "--json"]) == 20
    for entry in json.loads(capsys.readouterr().out):
        assert all(p["partly_landed"] is None for p in entry["patches"])


# --- the shipped lanes on the real sdists (cached) ------------------------------


@pytest.mark.integration
def test_check_on_the_embedded_default_reports_both_lanes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["check", "-q", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["lane"], e["version"], e["result"]) for e in entries] == [
        ("0.21.0", "0.21.0", "applies"),
        ("0.33.0", "0.33.0", "applies"),
    ]
    dropped = {p["patch"]: p["landed_by"] for p in entries[1]["patches"] if not p["carried"]}
    assert dropped == {}  # 0.33.0 carries every fix: the free callback synchronizes, sleep() did not


@pytest.mark.integration
def test_026_synchronizes_the_free_callback_but_not_sleep(tmp_path, monkeypatch, capsys):
    """vLLM 0.26.0 added the synchronize to the free callback only: the stream-aware free
    conflicts there, and the row says which half landed (it said only "conflict")."""
    monkeypatch.chdir(tmp_path)
    assert main(["check", "-q", "--vllm", "0.26.0", "--json"]) == 20
    [entry] = json.loads(capsys.readouterr().out)
    free = next(p for p in entry["patches"] if p["patch"] == "cumem-stream-aware-free")
    assert (entry["lane"], free["outcome"], free["partly_landed"]) == ("0.21.0", "conflict", {
        "landed": ["vllm/device_allocator/cumem.py::CuMemAllocator._python_free_callback"],
        "not_landed": ["vllm/device_allocator/cumem.py::CuMemAllocator.sleep"],
    })
    assert main(["check", "-q", "--vllm", "0.26.0"]) == 20
    row = next(line for line in capsys.readouterr().out.splitlines() if "cumem-stream-aware-free" in line)
    assert row.endswith("; partly landed upstream: vllm/device_allocator/cumem.py::CuMemAllocator._python_free_callback; "
                        "not landed: vllm/device_allocator/cumem.py::CuMemAllocator.sleep")
