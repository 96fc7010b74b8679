"""Run the real ``sm12x-bundle`` against hostile input, in a private world, and judge it.

Used by tests/test_hostile.py. Each case runs the command line (``python -m sm12x_bundle``,
the console script's own entry) in a new process inside a private temporary world (the
machine's bytecode cache aside, see guard_env):

    W/home/              HOME, with a dotfile
    W/home/work/         the working directory: keep.txt, notes/todo.md, cfg.yaml (a valid config
                         of the pinned release), small.yaml (a lane of W/srctree and one patch)
    W/srctree/           a small vLLM source tree (PKG-INFO, vllm/...): a lane that needs no cache
    W/beside/            a folder of someone else's beside the outputs
    W/dev/               fifo, sock (a bound socket), and as root full, null, zero (device nodes,
                         twins of /dev/full, /dev/null and /dev/zero: harmless to replace)
    W/links/             links to /dev/full, /dev/null, /dev/zero, ../dev/fifo, ../beside, a loop
    W/tmp/               TMPDIR, scratch: a crash's trace file lands there (not compared; the
                         crash shows in the exit code and the sentence)
    W/cache/             SM12X_BUNDLE_CACHE: empty, or (``trees``) a view of the machine's cache,
                         its sdists/ and trees/ linked, its locks/ its own
    W/mnt, W/ro, W/full  empty folders that namespace cases mount over

Nothing is downloaded (PIP_INDEX_URL names a missing folder, so a fetch fails at once) and no
Docker daemon answers (DOCKER_HOST names a missing socket). The process runs under the tripwire
of tests/hostile_site/sitecustomize.py: any change to the file system outside W (plus the
case's ``allow``) stops it before it happens, with exit 86, so a case may name /dev/full or
/etc without risk to the machine. Cases that need a read-only or full file system or a mount
point run in a private mount namespace (``unshare``), which the mounts die with.

Every entry under W is recorded (kind, mode; a file's sha256, mtime and links; a link's
target; a device's number) before and after, as are the machine cache's sdists and tree
records. A case passes when: the exit code is the expected one; the process ended within its
time (a FIFO must never block); stderr holds no traceback and exactly one error line (after
argparse's usage lines, nothing after it), which matches the case's phrase and is one sentence
(no longer than MAX_ERROR characters); a result code (0, 10, 20) leaves stderr empty; nothing under W changed but the paths the case says it may write, the
machine cache is as it was, and no staging folder (``.NAME.new-*``, ``.NAME.old-*``) is left,
in W, in /, or inside the namespace's mounts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SITE = TESTS / "hostile_site"
SRC = TESTS.parent / "src"
TRIPPED = 86  # the tripwire's exit code (hostile_site/sitecustomize.py)
MAX_ERROR = 500  # characters: an error longer than this is not one sentence (a list of paths)
STAGING = re.compile(r"^\..+\.(new|old)-")  # fsutil's staging folders: .NAME.new-XXXX, .NAME.old-XXXX
GiB = 1 << 30
MIB = 1 << 20
INSIDE = "ns-after.txt"  # what a namespace case's ``after`` lines print, at the top of W
RESULTS = (0, 10, 20)  # exit codes that report a result, not an error: nothing on stderr under -q


@dataclass(frozen=True)
class Case:
    """One hostile command line and what the tool must do with it.

    ``argv`` and ``env`` values may name ``{W}``, the world's folder. ``phrase`` is a regular
    expression the one error line must match (case ignored). ``writes``: paths under W the
    command was told to write (they may change). ``mounts``: shell lines run as root in a
    private mount namespace before the command; ``after``: lines run there after it, whose
    output must equal ``inside`` (W replaced by '{W}'), for what only the namespace sees.
    ``allow``: paths outside W where a refused attempt is harmless (/proc: the kernel says no).
    ``trees``: the case reads the pinned tree (W/cache is then a view of the machine's cache);
    ``devices``: it needs the device nodes in W/dev (root only). ``timeout`` (s) and ``memory``
    (bytes of address space) bound the process; ``slow`` marks a case that takes seconds.
    """

    id: str
    argv: tuple[str, ...]
    code: int
    phrase: str
    setup: Callable[[World], None] | None = None
    env: tuple[tuple[str, str | None], ...] = ()
    writes: tuple[str, ...] = ()
    trees: bool = False
    mounts: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    inside: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    devices: bool = False
    timeout: float = 30
    memory: int = 2 * GiB
    slow: bool = False


def case(id: str, command: str, code: int, phrase: str, **kw) -> Case:
    """A Case from a shell-like command line (split by shlex, ``{W}`` kept for later)."""
    env = tuple(kw.pop("env", {}).items())
    return Case(id, tuple(shlex.split(command)), code, phrase, env=env, **kw)


# --- the world -----------------------------------------------------------------------------

CANARIES = {
    "home/.profile": "a dotfile of the user's\n",
    "home/work/keep.txt": "the user's file in the working directory\n",
    "home/work/notes/todo.md": "the user's notes\n",
    "beside/keep.txt": "someone else's file beside the outputs\n",
    "beside/sub/deep.txt": "and one further down\n",
}
LINKS = {
    "full": "/dev/full",
    "null": "/dev/null",
    "zero": "/dev/zero",
    "fifo": "../dev/fifo",
    "sock": "../dev/sock",
    "folder": "../beside",
    "loop": "loop",
}
DEVICES = {"full": (1, 7), "null": (1, 3), "zero": (1, 5)}
SMALL_TREE = {
    "srctree/PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.21.0\n",
    "srctree/vllm/__init__.py": '__version__ = "0.21.0"\n',
    "srctree/vllm/device_allocator/cumem.py": "x = 1\n",
}
SMALL_LANE = """\
pin:
  version: "0.21.0"
  source: {W}/srctree
series: %s
"""


class World:
    """A private folder tree for one case, with its canaries (see the module docstring)."""

    def __init__(self, root: Path, config: str, machine_cache: Path | None, pycache: Path | None = None):
        from tools.patchkit import make_patch

        self.root = root
        self.machine_cache = machine_cache
        self.pycache = pycache
        small = {
            "home/work/small.yaml": SMALL_LANE % "small-series/series",
            "home/work/small-series/series": "0001-probe.patch\n",
            "home/work/small-series/0001-probe.patch": make_patch({"vllm/sm12x_probe.py": (None, "x = 1\n")}),
        }
        for rel, text in {**CANARIES, **SMALL_TREE, **small, "home/work/cfg.yaml": config}.items():
            self.write(rel, text)
        for rel in ("dev", "links", "tmp", "cache", "mnt", "ro", "full"):
            (root / rel).mkdir(exist_ok=True)
        os.mkfifo(root / "dev/fifo")
        with socket.socket(socket.AF_UNIX) as sock:  # the socket's file outlives the socket
            sock.bind(str(root / "dev/sock"))
        for name, target in LINKS.items():
            (root / "links" / name).symlink_to(target)
        if machine_cache is not None:
            for shelf in ("sdists", "trees"):
                (root / "cache" / shelf).symlink_to(machine_cache / shelf)

    def make_devices(self) -> None:
        for name, (major, minor) in DEVICES.items():
            os.mknod(self.root / "dev" / name, stat.S_IFCHR | 0o666, os.makedev(major, minor))

    def write(self, rel: str, data: str | bytes) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else self.sub(data).encode())
        return path

    def sub(self, text: str) -> str:
        return text.replace("{W}", str(self.root))

    @property
    def cwd(self) -> Path:
        return self.root / "home/work"

    def env(self, c: Case) -> dict[str, str]:
        env = guard_env([str(self.root), *(self.sub(a) for a in c.allow)], c.memory, self.pycache)
        env.update({
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "SM12X_BUNDLE_CACHE": str(self.root / "cache"),
            "PIP_INDEX_URL": (self.root / "no-index").as_uri(),
            "DOCKER_HOST": f"unix://{self.root}/no-daemon.sock",
        })
        for key, value in c.env:
            if value is None:
                env.pop(key, None)
            else:
                env[key] = self.sub(value)
        return env


def guard_env(writable: list[str], memory: int | None = None, pycache: Path | None = None) -> dict[str, str]:
    """A bare environment that loads the tripwire, letting the process change only ``writable``
    (and ``pycache``, where Python keeps the bytecode it compiles: shared by the cases, it
    saves each of them compiling the tool again; without it no bytecode is written)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join([str(SITE), str(SRC)]),
        "SM12X_HOSTILE_WRITABLE": os.pathsep.join([*writable, *([str(pycache)] if pycache else [])]),
    }
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # bytecode beside the sources would be a write outside
    if memory:
        env["SM12X_HOSTILE_MEMORY"] = str(memory)
    return env


# --- records ---------------------------------------------------------------------------------


def record(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed) but the relative paths in ``skip`` and
    what lies below them: what 'unchanged' compares."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames + filenames):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if any(rel == s or rel.startswith(s + "/") for s in skip):
                continue
            out[rel] = _entry(os.path.join(dirpath, name))
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in skip]
    return out


def _entry(path: str) -> tuple:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(MIB), b""):
                digest.update(block)
        return ("file", st.st_mode, st.st_nlink, st.st_mtime_ns, st.st_ino, digest.hexdigest())
    if stat.S_ISDIR(st.st_mode):
        return ("dir", st.st_mode)
    return (stat.S_IFMT(st.st_mode), st.st_mode, st.st_rdev, st.st_ino)


def differences(before: dict, after: dict) -> list[str]:
    return [f"{k}: {before.get(k)} -> {after.get(k)}" for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]


def machine_cache_stamps(cache: Path | None) -> dict[str, tuple]:
    """The machine cache's sdists and tree records (size, mtime, inode): the view's canaries."""
    if cache is None:
        return {}
    out = {}
    for path in sorted([*cache.glob("sdists/*/*"), *cache.glob("trees/*/*"), *cache.glob("trees/*/.sm12x-*")]):
        st = path.lstat()
        out[str(path.relative_to(cache))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def staging_left(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        found += [os.path.join(dirpath, n) for n in dirnames + filenames if STAGING.match(n)]
    return found


def root_staging() -> set[str]:
    return {n for n in os.listdir("/") if STAGING.match(n)}


# --- running -------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | None  # None: killed after the case's timeout
    stdout: str
    stderr: str
    seconds: float
    changed: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # of ``changed``: entries that were there before
    cache_changed: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    inside: list[str] = field(default_factory=list)
    error: str | None = None  # the harness itself failed to set the case up
    missing: str | None = None  # this machine cannot run the case (needs.missing says so)


def _argv(c: Case, world: World, unshare: list[str]) -> list[str]:
    cli = [sys.executable, "-m", "sm12x_bundle", *(world.sub(a) for a in c.argv)]
    if not c.mounts:
        return cli
    after = "; ".join(world.sub(a) for a in c.after) or "true"
    script = (
        " && ".join(world.sub(m) for m in c.mounts)
        + f' && {{ "$@"; rc=$?; {{ {after}; }} > "{world.root / INSIDE}" 2>&1; exit $rc; }}'
    )
    return [*unshare, "sh", "-c", script, "sh", *cli]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str, str, float]:
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a wrapper's child too
        out, err = proc.communicate()
        code = None
    return code, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - start


def run_case(
    c: Case, root: Path, config: str, machine_cache: Path | None, unshare: list[str], pycache: Path | None = None
) -> Outcome:
    """Build the world, record it, run the case, record again; the judging is ``problems``."""
    world = World(root, config, machine_cache if c.trees else None, pycache)
    if c.devices:
        world.make_devices()
    if c.setup:
        c.setup(world)
    skip = tuple(world.sub(w) for w in c.writes) + ("cache/locks", "tmp", INSIDE)
    before, cache_before, slash_before = record(root, skip), machine_cache_stamps(machine_cache), root_staging()
    code, out, err, seconds = _run(_argv(c, world, unshare), world.cwd, world.env(c), c.timeout)
    outcome = Outcome(code, out, err, seconds)
    after = record(root, skip)
    outcome.changed = differences(before, after)
    outcome.damaged = [k for k in before if before[k] != after.get(k)]
    outcome.cache_changed = differences(cache_before, machine_cache_stamps(machine_cache))
    outcome.leftovers = staging_left(root) + sorted("/" + n for n in root_staging() - slash_before)
    inside = root / INSIDE
    if c.mounts:
        outcome.inside = inside.read_text().replace(str(root), "{W}").splitlines() if inside.exists() else ["(not run)"]
    return outcome


def problems(c: Case, o: Outcome) -> list[str]:
    """Everything the outcome does wrong; an empty list: the case passed."""
    if o.error:
        return [f"the harness could not set the case up: {o.error}"]
    found = _exit_problems(c, o) + _stderr_problems(c, o)
    found += [f"changed outside what it was told to write: {d}" for d in o.changed]
    found += [f"the machine's cache changed: {d}" for d in o.cache_changed]
    found += [f"a staging folder was left: {p}" for p in o.leftovers]
    found += [f"left a staging folder inside a mount: {line}" for line in o.inside if STAGING.search(line.split("/")[-1])]
    if c.mounts and o.inside != list(c.inside):
        found.append(f"inside the namespace afterwards: {o.inside}, expected {list(c.inside)}")
    return found


def _exit_problems(c: Case, o: Outcome) -> list[str]:
    if o.code is None:
        return [f"hung: still running after {c.timeout:.0f} s (killed)"]
    if o.code == TRIPPED:
        return ["the tripwire stopped a change outside the world: " + o.stderr.strip().splitlines()[-1]]
    return [] if o.code == c.code else [f"exit {o.code}, expected {c.code}"]


def _stderr_problems(c: Case, o: Outcome) -> list[str]:
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    found = ["a traceback on stderr"] if "Traceback" in o.stderr else []
    if c.code in RESULTS:
        return found + ([f"stderr is not empty under -q: {lines[:3]}"] if lines else [])
    errors = [n for n, line in enumerate(lines) if ": error: " in line]
    if len(errors) != 1:
        return found + [f"{len(errors)} error lines on stderr, expected one: {lines[:4]}"]
    (at,) = errors
    usage = lines[0].startswith("usage:") and all(line.startswith(" ") for line in lines[1:at])
    if at and not usage:
        found.append(f"other lines before the error: {lines[:at][:3]}")
    if lines[at + 1 :]:
        found.append(f"the error goes on for {len(lines) - at} lines, not one sentence: {lines[at + 1 :][:2]}")
    error = lines[at]
    if not re.search(c.phrase, error, re.IGNORECASE):
        found.append(f"the error does not say /{c.phrase}/")
    if len(error) > MAX_ERROR:
        found.append(f"the error is {len(error)} characters long, not one sentence")
    return found


def classify(c: Case, o: Outcome) -> str:
    """How a case ended, for the table in docs/fuzzing.md: 'passed', or the worst of 'lost'
    (something that was in the world before was changed or removed, or a staging folder
    was left), 'stopped' (the tripwire stopped a change outside the world: it would have been
    lost), 'hung', 'crashed' (a traceback or the tool's 'unexpected failure, a bug'), 'wrong'
    (another exit code or sentence, a new file where nothing may be written, or a program
    it had no business starting)."""
    if o.missing or o.error:
        return "not run"
    found = problems(c, o)
    if not found:
        return "passed"
    if o.damaged or o.cache_changed or o.leftovers or any("staging" in f for f in found):
        return "lost"
    if o.code == TRIPPED and "may not start programs" not in o.stderr:
        return "stopped"
    if o.code is None:
        return "hung"
    if "Traceback" in o.stderr or "unexpected failure, a bug" in o.stderr:
        return "crashed"
    return "wrong"


def run_all(cases: list[Case], base: Path, config: str, machine_cache: Path, workers: int) -> dict[str, Outcome]:
    """Run ``cases`` concurrently, each in a world of its own under ``base``."""
    probe, pycache = base / "probe", base / "pycache"
    probe.mkdir()
    unshare = unshare_prefix(probe)
    warm = subprocess.run([sys.executable, "-m", "sm12x_bundle", "--version"], capture_output=True, timeout=120,
                          check=False, env=guard_env([str(probe)], pycache=pycache))  # compiles the bytecode once
    if warm.returncode != 0:
        raise RuntimeError(f"sm12x-bundle --version failed under the tripwire: {warm.stderr.decode()[-500:]}")

    def one(n: int, c: Case) -> Outcome:
        if c.mounts and unshare is None:
            return Outcome(None, "", "", 0, missing="this machine gives no private mount namespace (unshare -m)")
        if c.devices and os.geteuid() != 0:
            return Outcome(None, "", "", 0, missing="making device nodes (twins of /dev/null) needs root")
        root = base / f"w{n}"
        root.mkdir()
        try:
            return run_case(c, root, config, machine_cache, unshare or [], pycache)
        except Exception as exc:  # noqa: BLE001 - reported by the case's own test
            return Outcome(None, "", "", 0, error=f"{type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip([c.id for c in cases], pool.map(one, range(len(cases)), cases)))


def settled_cache(cache: Path, sha: str) -> Path:
    """``cache``, once the record of its tree ``sha`` is settled (young files are hashed again
    until they are old): a case's view of the cache then only ever reads."""
    from sm12x_bundle.source import extract, record

    for _ in range(3):
        header = json.loads((cache / "trees" / sha / record.NAME).read_text().partition("\n")[0])
        if header["settled"]:
            return cache
        time.sleep(record.RACY_NS / 1e9 + 0.1)
        extract.whole_tree(cache, sha)
    raise RuntimeError(f"the record of the cached tree {sha} does not settle")


def unshare_prefix(probe: Path) -> list[str] | None:
    """How to enter a private mount namespace here (as root, or as root of a user namespace),
    or None when this machine gives none. ``probe``: an empty folder to try a mount on."""
    ways = [["unshare", "-m", "--propagation", "private"]] if os.geteuid() == 0 else []
    ways.append(["unshare", "-rm", "--propagation", "private"])
    for way in ways:
        try:
            ok = subprocess.run([*way, "mount", "-t", "tmpfs", "tmpfs", str(probe)], capture_output=True, timeout=30,
                                check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return way
    return None
