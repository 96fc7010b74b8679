"""Hostile input at the command line: what a new user or a careless operator might type.

Each case runs the real ``sm12x-bundle`` in its own process, in a private world with canary
files, folders, a FIFO, a socket and device nodes, under a tripwire that stops any change
outside that world before it happens (tests/hostilekit.py says how, and what a case must
do to pass: its exit code, one error sentence matching its phrase, no traceback, no hang,
every canary unchanged, no staging folder left). The classes: report
and output paths that are not regular files or folders, --force at system folders and mount
points, read-only and full file systems, an unusable cache, configs that are bombs, deep,
not UTF-8, devices or empty, series and patches that are not what they claim, and every
ordinary bad invocation of tests/test_bad_input.py, run here as a user runs them.

The cases run concurrently (one process each, WORKERS at a time) in a module fixture, and
each test reports its own case. docs/fuzzing.md has the table of what they found.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import needs
import pytest
from hostilekit import (
    SMALL_LANE,
    TRIPPED,
    Case,
    GiB,
    Outcome,
    World,
    case,
    guard_env,
    problems,
    run_all,
    settled_cache,
)
from tools.patchkit import make_patch
from test_bad_input import BASE, ROWS, argv_of

from sm12x_bundle.source import cache as cache_mod

WORKERS = max(2, os.cpu_count() or 2)
# The small lane (W/srctree and one patch) needs no cache; cfg.yaml's pinned one reads the
# machine's cache through the world's view of it.
CHECK = "check -q --config small.yaml"
PINNED_FETCH = "fetch -q --config cfg.yaml"  # check reports a fetch error in its table; fetch says it
# Why /proc or /sys cannot be written: the system's words, not only the path.
KERNEL = r"file system|not permitted|denied"
APPLY = "apply -q --config small.yaml"
LANE_APPLY = "apply -q --config lane.yaml --out {W}/home/work/out"
# /lib64 and the like exist on some machines only; the tripwire keeps every one of them safe.
SYSTEM_FOLDERS = ["/etc", "/usr", "/var", "/boot", "/proc", "/sys", "/dev", "/bin", "/lib", "/lib64", "/opt",
                  "/srv", "/home", "/root"]


# --- setups ----------------------------------------------------------------------------------


def files(written: dict[str, str | bytes]):
    """Write files under W ({W} in text is the world's folder)."""
    def setup(world: World) -> None:
        for rel, data in written.items():
            world.write(rel, data)
    return setup


def config(data: str | bytes):
    return files({"home/work/bad": data})


def link(rel: str, target: str):
    return lambda world: (world.root / rel).symlink_to(target)


def fifo(rel: str):
    def setup(world: World) -> None:
        (world.root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(world.root / rel)
    return setup


def series(*entries: tuple[str, str | None], config_series: str = "patches/series"):
    """A one-lane config (lane.yaml) whose series lists ``entries``: (name, patch text, or None
    when the setup makes that entry itself)."""
    def setup(world: World) -> None:
        world.write("home/work/lane.yaml", SMALL_LANE % config_series)
        world.write("home/work/patches/series", "".join(name + "\n" for name, _ in entries))
        for name, text in entries:
            if text is not None:
                world.write(f"home/work/patches/{name}", text)
    return setup


def both(*setups):
    def setup(world: World) -> None:
        for s in setups:
            s(world)
    return setup


def alias_bomb(levels: int) -> str:
    """Each line a list naming the line before nine times: 9**levels values from a few lines."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


SYMLINK_PATCH = make_patch({"vllm/evil_link.py": (None, "/etc/passwd\n")}).replace(
    "new file mode 100644", "new file mode 120000"
)
UNDER_A_FILE_PATCH = make_patch({"vllm/__init__.py/evil.py": (None, "x = 1\n")})
GOOD_PATCH = make_patch({"vllm/sm12x_hostile_probe.py": (None, "x = 1\n")})
TMPFS_RO = "mount -t tmpfs -o ro,size=64k,mode=755 tmpfs {W}/ro"  # 755: not a cache others may write
TMPFS_FULL = "mount -t tmpfs -o size=64k tmpfs {W}/full && { cat /dev/zero > {W}/full/fill; } 2>/dev/null; true"
RO_BIND = "mount --bind {W}/ro {W}/ro && mount -o remount,bind,ro {W}/ro"
LIST = "find {W}/%s -mindepth 1 -printf '%%P %%s\\n' | sort"


# --- the cases --------------------------------------------------------------------------------

REPORT_PATHS = [
    # a report is written only as a new file or over a regular file
    case("junit-fifo", CHECK + " --junit {W}/dev/fifo", 2, r"is a FIFO", timeout=10),
    case("junit-socket", CHECK + " --junit {W}/dev/sock", 2, r"is a socket"),
    case("junit-device-full", CHECK + " --junit {W}/dev/full", 2, r"character device", devices=True),
    case("junit-device-null", CHECK + " --junit {W}/dev/null", 2, r"character device", devices=True),
    case("junit-link-to-dev-full", CHECK + " --junit {W}/links/full", 2, r"character device"),
    case("junit-link-to-fifo", CHECK + " --junit {W}/links/fifo", 2, r"a FIFO", timeout=10),
    case("junit-real-dev-full", CHECK + " --junit /dev/full", 2, r"character device"),
    case("junit-real-dev-null", CHECK + " --junit /dev/null", 2, r"character device"),
    case("junit-link-to-folder", CHECK + " --junit {W}/links/folder", 2, r"is a folder"),
    case("junit-under-a-fifo", CHECK + " --junit {W}/dev/fifo/report.xml", 2, r"not a folder"),
    case("json-out-fifo", "selftest -q --installed --json-out {W}/dev/fifo", 2, r"is a FIFO", timeout=10),
    case("json-out-link-to-dev-null", "selftest -q --installed --json-out {W}/links/null", 2, r"character device"),
    # what the machine refuses is the environment's (exit 12), named
    case("junit-proc-version", CHECK + " --junit /proc/version", 12, KERNEL),
    case("junit-under-proc", CHECK + " --junit /proc/sm12x-report.xml", 12, KERNEL),
    case("junit-under-sys", CHECK + " --junit /sys/sm12x-report.xml", 12, KERNEL),
    case("junit-read-only-folder", CHECK + " --junit {W}/ro/report.xml", 12, r"read-only file system",
         mounts=(TMPFS_RO,), after=(LIST % "ro",)),
    case("junit-full-disk", CHECK + " --junit {W}/full/report.xml", 12, r"no space left on device",
         mounts=(TMPFS_FULL,), after=(LIST % "full",), inside=("fill 65536",)),
    # controls: what may be written is written, and only that (the first on the pinned tree)
    case("junit-new-file-pinned-tree", "check -q --config cfg.yaml --junit {W}/home/work/reports/check.xml", 0, "",
         trees=True, writes=("home/work/reports",)),
    case("junit-over-a-regular-file", CHECK + " --junit {W}/home/work/old.xml", 0, "",
         setup=files({"home/work/old.xml": "<old/>\n"}), writes=("home/work/old.xml",)),
]

OUTPUT_FOLDERS = [
    case("out-fifo", APPLY + " --out {W}/dev/fifo", 11, r"is a FIFO|not a folder this tool wrote"),
    # --force replaces a folder, never a device, FIFO or socket
    case("out-fifo-force", APPLY + " --out {W}/dev/fifo --force", 11, r"is a FIFO"),
    case("out-socket-force", APPLY + " --out {W}/dev/sock --force", 11, r"is a socket"),
    case("out-device-force", APPLY + " --out {W}/dev/null --force", 11, r"character device", devices=True),
    # --force at a link replaces the link, never what it points to
    case("out-link-to-folder-force", APPLY + " --out {W}/links/folder --force", 0, "",
         writes=("links/folder",)),
    # --force never moves a system folder (the tripwire stops any attempt first)
    *[case(f"out-system-folder-{p.strip('/')}-force", APPLY + f" --out {p} --force", 11, r"even with --force")
      for p in SYSTEM_FOLDERS],
    case("out-system-folder-etc-force-pinned-tree", "apply -q --config cfg.yaml --out /etc --force", 11,
         r"even with --force", trees=True),
    case("out-system-folder-via-link-force", APPLY + " --out {W}/links/etc --force", 11, r"even with --force",
         setup=link("links/etc", "/etc")),
    # ... nor a mount point, nor a folder that holds one
    case("out-mount-point-force", APPLY + " --out {W}/mnt --force", 11, r"mount point",
         mounts=("mount -t tmpfs -o size=1m tmpfs {W}/mnt && echo canary > {W}/mnt/keep.txt",),
         after=(LIST % "mnt",), inside=("keep.txt 7",)),
    case("out-holds-a-mount-force", APPLY + " --out {W}/beside --force", 11, r"mount point",
         mounts=("mount -t tmpfs -o size=1m tmpfs {W}/beside/sub && echo canary > {W}/beside/sub/in-mount.txt",),
         after=(LIST % "beside/sub",), inside=("in-mount.txt 7",)),
    case("out-read-only-mount-force", APPLY + " --out {W}/ro --force", 11, r"mount point",
         setup=files({"ro/keep.txt": "a file on a read-only mount\n"}), mounts=(RO_BIND,), after=("true",)),
    # the folders the tool never replaces, as a careless operator names them
    *[case(f"out-{name}-force", APPLY + f" --out {path} --force", 11, r"even with --force")
      for name, path in [("dot", "."), ("dotdot", ".."), ("home", "~"), ("home-var", "{W}/home"), ("root", "/"),
                         ("empty", "''"), ("parent-of-cwd", "{W}")]],
    # the files an output folder holds: a FIFO where the manifest goes is never replaced
    case("overlay-out-fifo", "overlay -q --config cfg.yaml --out {W}/dev/fifo", 11, r"a FIFO|not a folder",
         trees=True),
    case("overlay-manifest-is-a-fifo-force", "overlay -q --config cfg.yaml --out {W}/ovl --force", 11, r"a FIFO",
         trees=True, setup=fifo("ovl/vllm-openai-v0.21.0/current.json"), timeout=10),
    # a read-only or full file system, /proc, /sys: exit 12 and the system's words
    case("out-inside-read-only", APPLY + " --out {W}/ro/tree", 12, r"read-only file system",
         mounts=(TMPFS_RO,), after=(LIST % "ro",)),
    case("out-full-disk", APPLY + " --out {W}/full/tree", 12, r"no space left on device",
         mounts=(TMPFS_FULL,), after=(LIST % "full",), inside=("fill 65536",)),
    # the reported case: the pinned tree onto 1 MiB, which fails on thousands of files
    case("out-full-disk-pinned-tree", "apply -q --config cfg.yaml --out {W}/full/tree", 12, r"no space left on device",
         mounts=("mount -t tmpfs -o size=1m tmpfs {W}/full && echo canary > {W}/full/keep.txt",),
         after=(LIST % "full",), inside=("keep.txt 7",), trees=True, slow=True),
    case("out-under-proc", APPLY + " --out /proc/sm12x-tree", 12, KERNEL),
    case("out-under-sys", APPLY + " --out /sys/sm12x-tree", 12, KERNEL),
]

CACHES = [
    # a cache this machine will not let the tool use
    case("cache-is-a-file", PINNED_FETCH, 12, r"not a folder", setup=files({"cachefile": "x\n"}),
         env={"SM12X_BUNDLE_CACHE": "{W}/cachefile"}),
    case("cache-under-a-file", PINNED_FETCH, 12, r"not a folder", setup=files({"cachefile": "x\n"}),
         env={"SM12X_BUNDLE_CACHE": "{W}/cachefile/sub"}),
    case("xdg-cache-is-a-file", PINNED_FETCH, 12, r"not a folder", setup=files({"cachefile": "x\n"}),
         env={"SM12X_BUNDLE_CACHE": None, "XDG_CACHE_HOME": "{W}/cachefile"}),
    case("cache-is-dev-null", PINNED_FETCH, 12, r"not a folder", env={"SM12X_BUNDLE_CACHE": "/dev/null"},
         allow=("/dev/null",)),
    case("cache-under-proc", PINNED_FETCH, 12, KERNEL, env={"SM12X_BUNDLE_CACHE": "/proc/sm12x-cache"}, allow=("/proc",)),
    case("cache-read-only", PINNED_FETCH, 12, r"read-only file system", env={"SM12X_BUNDLE_CACHE": "{W}/ro"},
         mounts=(TMPFS_RO,), after=(LIST % "ro",)),
]

CONFIGS = [
    # bounded YAML, and a file that is not text names itself (exit 3)
    case("config-alias-bomb-7", "series -q --config bad", 3, r"alias|anchor", setup=config(alias_bomb(7)),
         timeout=10, memory=GiB),
    case("config-alias-bomb-9", "series -q --config bad", 3, r"alias|anchor", setup=config(alias_bomb(9)),
         timeout=10, memory=GiB),
    case("config-nested-lists", "series -q --config bad", 3, r"bad:1: .*(nest|deep)",
         setup=config("[" * 50_000 + "]" * 50_000 + "\n"), timeout=10, memory=GiB),
    case("config-nested-mappings", "series -q --config bad", 3, r"bad:1: .*(nest|deep)",
         setup=config("{a: " * 50_000 + "}" * 50_000 + "\n"), timeout=10, memory=GiB),
    case("config-not-utf8", "series -q --config bad", 3, r"bad.*UTF-8",
         setup=config(BASE.replace("check:", "# caf\xe9\ncheck:").encode("latin-1"))),
    case("config-utf16", "series -q --config bad", 3, r"bad.*UTF-8", setup=config(BASE.encode("utf-16"))),
    case("config-dev-zero", "series -q --config /dev/zero", 3, r"/dev/zero.*character device", timeout=10,
         memory=GiB),
    case("config-dev-null", "series -q --config /dev/null", 3, r"character device"),
    case("config-link-to-dev-zero", "series -q --config {W}/links/zero", 3, r"character device", timeout=10,
         memory=GiB),
    case("config-fifo", "series -q --config {W}/dev/fifo", 3, r"is a FIFO", timeout=10),
    case("config-socket", "series -q --config {W}/dev/sock", 3, r"is a socket"),
    case("config-link-loop", "series -q --config {W}/links/loop", 3, r"symbolic links"),
    case("config-too-large", "series -q --config bad", 3, r"bad.*(large|size)",
         setup=config("# padding\n" * 400_000 + BASE), timeout=60, slow=True),
    case("config-huge-scalar", "series -q --config bad", 3, r"bad.*(large|size)",
         setup=config(BASE + "# " + "x" * (4 * 1 << 20) + "\n"), timeout=60, slow=True),
    case("config-huge-integer", "series -q --config bad", 3, r"bad:\d+: .*digits",
         setup=config(BASE.replace("fuzz: 0", "fuzz: " + "9" * 5000))),
    case("config-nul-byte", "series -q --config bad", 3, r"bad:\d+: not valid YAML", setup=config(BASE.replace("fuzz: 0", "fuzz: 0\0"))),
    case("config-python-tag", "series -q --config bad", 3, r"tag",
         setup=config("pin: !!python/object/apply:os.system ['true']\n")),
    # a file an operator passes means something: empty is refused
    case("config-empty", "series -q --config bad", 3, r"bad:1: .*(empty|no settings)", setup=config("")),
    case("config-comments-only", "series -q --config bad", 3, r"bad:1: .*(empty|no settings)", setup=config("# nothing here\n")),
    case("config-empty-mapping", "series -q --config bad", 3, r"bad:1: .*(empty|no settings)", setup=config("{}\n")),
    # --dry-run checks what build checks (here: the daemon an unpinned target needs)
    case("dry-run-needs-what-build-needs", "build -q --dry-run --config bad", 8, r"daemon",
         setup=config(BASE[: BASE.index("    pinned: true")])),
]

SERIES = [
    # a series file or entry that is not a regular file says what it is
    case("series-file-dev-zero", "series -q --config lane.yaml", 3, r"character device",
         setup=series(config_series="/dev/zero"), timeout=10, memory=GiB),
    case("series-file-fifo", "series -q --config lane.yaml", 3, r"is a FIFO",
         setup=series(config_series="{W}/dev/fifo"), timeout=10),
    case("series-file-folder", "series -q --config lane.yaml", 3, r"is a folder",
         setup=series(config_series="{W}/beside")),
    case("series-entry-link-to-dev-zero", LANE_APPLY, 5, r"character device", timeout=10, memory=GiB,
         setup=both(series(("0001-zero.patch", None)), link("home/work/patches/0001-zero.patch", "/dev/zero"))),
    case("series-entry-fifo", LANE_APPLY, 5, r"is a FIFO", timeout=10,
         setup=both(series(("0001-fifo.patch", None)), fifo("home/work/patches/0001-fifo.patch"))),
    case("series-entry-folder", LANE_APPLY, 5, r"is a folder",
         setup=both(series(("0001-dir.patch", None)),
                    lambda w: (w.root / "home/work/patches/0001-dir.patch").mkdir())),
    case("series-entry-missing", LANE_APPLY, 5, r"0001-gone\.patch",
         setup=series(("0001-gone.patch", None))),
    # patches that are not what a patched tree may hold
    case("patch-symlink", LANE_APPLY, 5, r"symlink|symbolic link|120000",
         setup=series(("0001-link.patch", SYMLINK_PATCH))),
    case("patch-adds-under-a-file", LANE_APPLY, 6, r"vllm/__init__\.py",
         setup=series(("0001-under.patch", UNDER_A_FILE_PATCH))),
    case("patch-escapes-the-tree", LANE_APPLY, 5, r"\.\.",
         setup=series(("0001-up.patch", make_patch({"../escape.py": (None, "x = 1\n")})))),
    case("patch-absolute-path", LANE_APPLY, 5, r"/etc/sm12x",
         setup=series(("0001-abs.patch", make_patch({"/etc/sm12x.py": (None, "x = 1\n")})))),
    case("patch-not-utf8", LANE_APPLY, 5, r"UTF-8",
         setup=series(("0001-latin.patch", GOOD_PATCH.replace("x = 1", "x = 'caf\xe9'").encode("latin-1")))),
    # a control: the same lane with a good patch writes its tree, and only there
    case("patch-good-control", LANE_APPLY, 0, "", writes=("home/work/out",),
         setup=series(("0001-good.patch", GOOD_PATCH))),
]


def _bad_input(row) -> Case:
    """A row of tests/test_bad_input.py, run as a user runs it."""
    name, argv, edit, code, fragment = row
    setup = files({"home/work/cfg.yaml": edit.text()}) if edit is not None else None
    return Case("bad-input-" + name, tuple(argv_of(argv, edit)), code, re.escape(fragment), setup=setup)


# The classes of hostile input, as docs/fuzzing.md counts them (scripts/fuzz --target hostile).
CLASSES: dict[str, list[Case]] = {
    "report files (--junit, --json-out)": REPORT_PATHS,
    "output folders (--out, --force)": OUTPUT_FOLDERS,
    "the cache": CACHES,
    "configs": CONFIGS,
    "series and patches": SERIES,
    "ordinary bad input (tests/test_bad_input.py)": [_bad_input(row) for row in ROWS],
}
CASES: list[Case] = [c for cases in CLASSES.values() for c in cases]


# --- running them ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def machine_cache(pinned_source) -> Path:
    """The machine's cache, holding the pinned 0.21.0 sdist and its tree (the conftest fetches
    them if missing): the cases that reach a tree see it through a read-only view."""
    return settled_cache(cache_mod.cache_dir(), pinned_source.sha256)


def _selected(request) -> list[Case]:
    """The cases this run selected (-k, -m), so that a narrow run runs only those."""
    items = [i for i in request.session.items if i.module.__name__ == __name__ and hasattr(i, "callspec")]
    return [i.callspec.params["c"] for i in items if "c" in i.callspec.params]


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, machine_cache) -> dict[str, Outcome]:
    return run_all(_selected(request), tmp_path_factory.mktemp("hostile"), BASE, machine_cache, WORKERS)


PARAMS = [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]


@pytest.mark.parametrize("c", PARAMS)
def test_hostile_input_is_refused_cleanly(c, outcomes):
    o = outcomes[c.id]
    if o.missing:
        needs.missing(o.missing)
    found = problems(c, o)
    assert not found, "\n".join([*found, f"exit {o.code} after {o.seconds:.1f} s; stderr: {o.stderr[-1500:]!r}"])


def test_the_table_is_large_and_its_ids_unique():
    assert len(CASES) >= 120 and len({c.id for c in CASES}) == len(CASES)


def test_the_tripwire_stops_a_write_outside_the_world_before_it_happens(tmp_path):
    """The guard the cases rely on: a write, a folder, a rename and a program outside W are
    stopped with exit 86 and leave nothing; the same inside W go through."""
    world, outside = tmp_path / "w", tmp_path / "outside"
    world.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("keep\n")
    tries = {
        f"open({str(outside / 'new')!r}, 'w')": TRIPPED,
        f"import os; os.mkdir({str(outside / 'dir')!r})": TRIPPED,
        f"import os; os.replace({str(outside / 'keep')!r}, {str(outside / 'moved')!r})": TRIPPED,
        f"import shutil; shutil.rmtree({str(outside)!r})": TRIPPED,
        f"import os; os.symlink({str(outside)!r}, {str(world / 'l')!r}); open({str(world / 'l' / 'x')!r}, 'w')": TRIPPED,
        "import subprocess; subprocess.run(['true'])": TRIPPED,
        "open('/dev/null', 'w')": TRIPPED,
        "import os; os.close(os.open('/dev/null', os.O_RDWR))": 0,
        f"open({str(world / 'fine')!r}, 'w').write('x')": 0,
    }
    for code, expected in tries.items():
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env=guard_env([str(world)]), check=False)
        assert proc.returncode == expected, (code, proc.stderr)
        assert ("sm12x-hostile-guard: stopped" in proc.stderr) == (expected == TRIPPED), proc.stderr
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert sorted(p.name for p in world.iterdir()) == ["fine", "l"]
