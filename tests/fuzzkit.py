"""Hostile inputs for the untrusted-input parsers, and the properties they must keep.

Used by tests/test_fuzz.py (a small fixed budget in CI) and scripts/fuzz (a long one).
Each ``check_*`` function takes one generated input, runs the real code on it in a private
temporary folder, and raises ``Finding`` when a property breaks: an exception that is not
the typed error, a write outside the destination, an unsafe entry left in a tree, or (for
configs) more time or memory than a config may take.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import hashlib
import lzma
import os
import resource
import shutil
import signal
import stat
import tarfile
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml
from hypothesis import strategies as st

from sm12x_bundle.errors import BundleError, FetchError
from sm12x_bundle.series.apply import HunkFailure, VirtualTree, apply_file_patch
from sm12x_bundle.series.patch import load_series
from sm12x_bundle.source.extract import cached_tree

SENTINEL = "@SENTINEL@"  # replaced by the absolute path of the sentinel folder beside the cache

# What the harnesses saw, per target; scripts/fuzz prints it.
TRIED: Counter[str] = Counter()
OUTCOMES: Counter[tuple[str, str]] = Counter()  # (target, how the input ended)


class Finding(AssertionError):
    """A property broke. ``kind``: 'traceback' (an untyped exception), 'outside' (a write or
    link outside, or an unsafe entry in the tree), 'hang' (scripts/fuzz's limit, or a
    config's) or 'memory' (a config's)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(f"{kind}: {message}")


# ---------------------------------------------------------------- snapshots


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Everything under ``root`` (not following links), except the relative paths in ``skip``."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in skip]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel in skip:
                continue
            st_ = os.lstat(path)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st_.st_mode):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                out[rel] = ("file", st_.st_mode, st_.st_nlink, st_.st_mtime_ns, digest)
            else:
                out[rel] = (stat.S_IFMT(st_.st_mode), st_.st_mode)
    return out


def _diff(before: dict, after: dict) -> list[str]:
    keys = sorted(set(before) | set(after))
    return [f"{k}: {before.get(k)} -> {after.get(k)}" for k in keys if before.get(k) != after.get(k)]


@contextmanager
def _workspace():
    base = Path(tempfile.mkdtemp(prefix="sm12x-fuzz-"))
    try:
        sentinel = base / "sentinel"
        sentinel.mkdir()
        (sentinel / "keep").write_text("must not change\n")
        yield base
    finally:
        _force_rmtree(base)


def _force_rmtree(path: Path) -> None:
    # An extracted folder may have lost its write bit; give it back so cleanup works.
    def fix(func, p, _exc):
        os.chmod(os.path.dirname(p), 0o700)
        func(p)

    shutil.rmtree(path, onerror=fix)


# ---------------------------------------------------------------- sdists


def _rarely(strategy, otherwise=None):
    """``strategy`` about one time in 24, else ``otherwise``: with a dozen places that can go
    wrong, about half the inputs get past the first check and reach the deeper code."""
    # A middle index: Hypothesis favours the ends of a range (and one_of drops repeats).
    return st.integers(0, 23).flatmap(lambda i: strategy if i == 12 else st.just(otherwise))


_NAME_PREFIX = st.sampled_from(["top/"] * 6 + ["", "/", "../", "top/../", "./top/", "top/sub/../../"])
_COMPONENT = st.sampled_from(["a", "b", "sub", "link", "keep", "..", ".", "", "sentinel", "x" * 120, "é"])
_KINDS = ["file", "dir", "symlink", "hardlink", "chr", "blk", "fifo", "contig", "sparse", "pax-huge", "longname-huge"]
_HUGE = st.sampled_from([0, 1, 511, 513, 8**11 - 1, 1 << 33, 1 << 40, 1 << 62])


def _link_target():
    return st.one_of(
        st.lists(_COMPONENT, min_size=1, max_size=4).map("/".join),
        st.integers(0, 6).map(lambda k: "../" * k + "sentinel/keep"),
        st.sampled_from([SENTINEL + "/keep", "/etc/passwd", "top/a", "top/link", "top/sub/a", "top/missing"]),
    )


@dataclass(frozen=True)
class Member:
    kind: str
    name: str
    link: str
    data: bytes
    size: int | None  # declared size when it differs from len(data)
    mode: int


_MEMBER = st.builds(
    Member,
    kind=st.sampled_from(["file", "dir", "symlink", "hardlink"] * 3 + _KINDS),
    name=st.builds(lambda p, parts: p + "/".join(parts), _NAME_PREFIX, st.lists(_COMPONENT, min_size=0, max_size=3)),
    link=_link_target(),
    data=st.binary(max_size=600),
    size=_rarely(_HUGE),
    mode=st.sampled_from([0o644, 0o755, 0o000, 0o4755, 0o777, 0o200]),
)


@dataclass(frozen=True)
class Archive:
    members: tuple[Member, ...]
    compression: str
    cut: float | None  # keep this fraction of the bytes (a truncated download)
    junk: bytes  # appended after the end (or the whole file when raw)
    flips: tuple[tuple[float, int], ...]  # (where, xor) byte corruptions
    raw: bool  # the file is only ``junk``


ARCHIVES = st.builds(
    Archive,
    members=st.lists(_MEMBER, min_size=1, max_size=8).map(tuple),
    compression=st.sampled_from(["gz", "gz", "tar", "bz2", "xz"]),
    cut=_rarely(st.floats(0, 1)),
    junk=_rarely(st.binary(min_size=1, max_size=64), b""),
    flips=_rarely(
        st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=3).map(tuple), ()
    ),
    raw=_rarely(st.just(True), False),
)


def _header(name: str, type_: bytes, size: int, mode: int = 0o644, link: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.linkname = type_, size, mode, link
    return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")


def _sparse_header(name: str, data: bytes, realsize: int) -> bytes:
    """An old-GNU sparse member (tarfile cannot write one): one data run, a huge real size."""
    buf = bytearray(_header(name, tarfile.REGTYPE, len(data)))
    h = len(buf) - tarfile.BLOCKSIZE  # the member's own header (after any long-name block)
    buf[h + 156] = ord(tarfile.GNUTYPE_SPARSE)
    buf[h + 386 : h + 398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)
    buf[h + 398 : h + 410] = tarfile.itn(len(data), 12, tarfile.GNU_FORMAT)
    buf[h + 483 : h + 495] = tarfile.itn(realsize, 12, tarfile.GNU_FORMAT)
    chksum = 256 + sum(buf[h : h + 148]) + sum(buf[h + 156 : h + 512])
    buf[h + 148 : h + 156] = b"%06o\0 " % chksum
    return bytes(buf)


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
    "contig": tarfile.CONTTYPE,
    "pax-huge": tarfile.XHDTYPE,
    "longname-huge": tarfile.GNUTYPE_LONGNAME,
}


def _member_bytes(m: Member, sentinel: str) -> bytes:
    link = m.link.replace(SENTINEL, sentinel)
    data = m.data if m.kind in ("file", "contig", "sparse", "pax-huge", "longname-huge") else b""
    size = len(data) if m.size is None else m.size
    if m.kind == "sparse":
        head = _sparse_header(m.name, data, size or 1 << 40)
    else:
        head = _header(m.name, _TYPES[m.kind], size, m.mode, link if m.kind in ("symlink", "hardlink") else "")
    return head + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def archive_bytes(a: Archive, sentinel: str) -> bytes:
    if a.raw:
        return a.junk
    tar = b"".join(_member_bytes(m, sentinel) for m in a.members) + b"\0" * (2 * tarfile.BLOCKSIZE)
    packed = {"gz": lambda b: gzip.compress(b, mtime=0), "tar": bytes, "bz2": bz2.compress, "xz": lzma.compress}[
        a.compression
    ](tar)
    out = bytearray(packed)
    for where, xor in a.flips:
        out[int(where * len(out))] ^= xor
    if a.cut is not None:
        out = out[: int(a.cut * len(out))]
    return bytes(out) + a.junk


def check_extract(a: Archive) -> None:
    """Extract or FetchError; nothing outside the destination; the tree holds only safe entries."""
    TRIED["sdist extractor"] += 1
    with _workspace() as base:
        raw = archive_bytes(a, str(base / "sentinel"))
        sha = hashlib.sha256(raw).hexdigest()  # the cache folder name the extractor verifies
        sdist = base / "sdists" / sha / "vllm-9.0.0.tar.gz"
        sdist.parent.mkdir(parents=True)
        sdist.write_bytes(raw)
        for made_by_the_cache in ("trees", "locks"):
            (base / "cache" / made_by_the_cache).mkdir(parents=True)
        dest = base / "cache" / "trees" / sha
        skip = (os.path.relpath(dest, base), os.path.join("cache", "locks"))
        before = snapshot(base, skip)
        try:
            root = cached_tree(sdist, base / "cache")
            OUTCOMES["sdist extractor", "extracted"] += 1
        except FetchError as exc:
            OUTCOMES["sdist extractor", _reason(str(exc))] += 1
            root = None
        except Exception as exc:
            raise Finding("traceback", f"{type(exc).__name__}: {exc}") from exc
        changed = _diff(before, snapshot(base, skip))
        if changed:
            raise Finding("outside", "; ".join(changed[:5]))
        if root is not None:
            # Deflate expands at most about 1032:1; the generated members carry under 5 KB of
            # data, far below this bound for any of the compressions used.
            _check_tree(dest, root, uncompressed_bound=len(raw) * 1100 + 10 * tarfile.BLOCKSIZE)


def _reason(message: str) -> str:
    """The kind of a refusal, without the names in it: 'FetchError: member ... is a sparse file'."""
    for key in (
        "absolute",
        "'..'",
        "outside the tree",
        "not a regular",
        "sparse",
        "goes through the symlink",
        "hard link",
        "replace a folder",
        "loop of symlinks",
        "name is not plain",
        "top-level",
        "too large",
        "not a readable",
        "not a directory",
    ):
        if key in message:
            return "refused: " + key.strip("'")
    return "refused: other (" + message[:60] + ")"


def _check_tree(dest: Path, root: Path, uncompressed_bound: int) -> None:
    if root.parent != dest or root.is_symlink() or not root.is_dir():
        raise Finding("outside", f"the tree root {root} is not a real folder directly in {dest}")
    real_dest = os.path.realpath(dest)
    inodes: Counter[int] = Counter()
    links: dict[int, int] = {}
    total = 0
    for path in [dest, *dest.rglob("*")]:
        st_ = path.lstat()
        if stat.S_ISLNK(st_.st_mode):
            target = os.path.realpath(path)
            if os.path.commonpath([target, real_dest]) != real_dest:
                raise Finding("outside", f"{path.relative_to(dest)} links outside the tree to {target}")
        elif stat.S_ISREG(st_.st_mode):
            inodes[st_.st_ino] += 1
            links[st_.st_ino] = st_.st_nlink
            total += st_.st_size if inodes[st_.st_ino] == 1 else 0
        elif not stat.S_ISDIR(st_.st_mode):
            raise Finding("outside", f"{path.relative_to(dest)} is a device, fifo or socket")
    for ino, seen in inodes.items():
        if links[ino] != seen:  # a hard link shared with a file outside the tree
            raise Finding("outside", f"a file in the tree has {links[ino]} links, {seen} of them in the tree")
    if total > uncompressed_bound:
        raise Finding("outside", f"the tree holds {total} bytes, more than the archive can carry")


# ---------------------------------------------------------------- patches

HEADERS = (
    "Description: fuzz",
    "Origin: https://example.invalid/1",
    "Forwarded: no",
    "Applied-Upstream: no",
    "Last-Update: 2026-11-22",
)
TREE_LINES = ["import os", "", "def f():", "    return 1", "", "x = 2"]
PATHS = [
    "a.py", "sub/b.py", "noeol.py", "crlf.py", "bin.dat", "dir", "missing.py",
    "link/a.py", "link", "loop/a.py", "loop", "fifo",
    "../a.py", "/etc/passwd", "sub/../a.py", "./a.py", "a//b.py", "a\\b.py", "nul\0.py",
    "é/ü.py", "x" * 300 + ".py", "sub/" + "y" * 256,
]  # fmt: skip


def make_tree(root: Path, outside: Path) -> None:
    """A small pristine tree with the awkward entries a real sdist may hold."""
    (root / "sub").mkdir(parents=True)
    (root / "dir").mkdir()
    outside.mkdir(exist_ok=True)
    (outside / "a.py").write_text("\n".join(TREE_LINES) + "\n")
    (root / "a.py").write_text("\n".join(TREE_LINES) + "\n")
    (root / "sub" / "b.py").write_text("\n".join(TREE_LINES) + "\n")
    (root / "noeol.py").write_text("\n".join(TREE_LINES))
    (root / "crlf.py").write_bytes(("\r\n".join(TREE_LINES) + "\r\n").encode())
    (root / "bin.dat").write_bytes(bytes(range(256)))
    (root / "link").symlink_to(os.path.relpath(outside, root))
    (root / "loop").symlink_to("loop")
    os.mkfifo(root / "fifo")


_TEXT_LINE = st.one_of(
    st.sampled_from(TREE_LINES),
    st.text(max_size=20),
    st.sampled_from(["x" * 5000, "\0\0", "\r", "\ufffd"]),
)
_COUNT = st.one_of(st.integers(0, 8), st.sampled_from([10**6, 10**18, 2**64]))


@st.composite
def _hunk(draw) -> list[str]:
    """A hunk against TREE_LINES (so it can apply), then maybe a wrong count or a junk line."""
    k = draw(st.integers(0, len(TREE_LINES)))
    body = []
    for line in TREE_LINES[k : k + draw(st.integers(0, len(TREE_LINES) - k))]:
        body.append(draw(st.sampled_from(" -")) + line)
        body += ["+" + text for text in draw(st.lists(_TEXT_LINE, max_size=1))]
    body += ["+" + text for text in draw(st.lists(_TEXT_LINE, min_size=0 if body else 1, max_size=2))]
    odd = ["\\ No newline at end of file", "", "junk", "@@ -1 +1 @@", "-import os", " missing"]
    for where, line in draw(_rarely(st.lists(st.tuples(st.integers(0, len(body)), st.sampled_from(odd))), [])):
        body.insert(where, line)
    old = draw(_rarely(_COUNT, sum(1 for line in body if line[:1] in " -")))
    new = draw(_rarely(_COUNT, sum(1 for line in body if line[:1] in " +")))
    start = draw(_rarely(_COUNT, k + 1))
    header = draw(
        _rarely(st.sampled_from(["@@ -{s} +{s} @@", "@@ junk @@", "@@", "@@ -{s},x +1 @@"]), "@@ -{s},{o} +{s},{n} @@")
    )
    return [header.format(s=start, o=old, n=new), *body]


@st.composite
def _file_section(draw) -> list[str]:
    path = draw(
        st.one_of(st.sampled_from(["a.py", "sub/b.py", "noeol.py"] * 4 + PATHS), st.text(min_size=1, max_size=12))
    )
    other = draw(_rarely(st.just("a.py"), path))
    lines = [f"diff --git a/{path} b/{other}"]
    extra = st.sampled_from(
        ["new file mode 100644", "new file mode 100755", "new file mode 10x644", "new file mode ",
         "deleted file mode 100644", "index 000..111 100644", "similarity index 90%", "rename from a.py",
         "GIT binary patch", "old mode 100644"]
    )  # fmt: skip
    lines += draw(_rarely(st.lists(extra, max_size=2), []))
    old = draw(_rarely(st.sampled_from(["--- /dev/null", f"--- {path}", None]), f"--- a/{path}"))
    new = draw(_rarely(st.sampled_from(["+++ /dev/null", f"+++ b/{other}\t2026", None]), f"+++ b/{other}"))
    lines += [line for line in (old, new) if line is not None]
    for hunk in draw(st.lists(_hunk(), max_size=3)):
        lines += hunk
    return lines


@st.composite
def patch_texts(draw) -> bytes:
    """A git format-patch file from a grammar, then maybe damaged at the byte level."""
    headers = list(HEADERS) + [
        draw(_rarely(st.sampled_from(["Sm12x-Kind: native", "Sm12x-Kind: odd"]), "Sm12x-Kind: python"))
    ]
    headers += draw(
        _rarely(
            st.lists(
                st.sampled_from(
                    ["Sm12x-Builds: vllm/x.so", "Sm12x-Probe: a.py ~ def f", "Sm12x-Probe: a.py::f ~ (",
                     "Sm12x-Probe: ../a.py ~ x", "Sm12x-Probe: a.py ~ " + "(" * 300 + ")" * 300, "Bug: 1", " continued"]
                ),
                max_size=3,
            ),
            [],
        )
    )  # fmt: skip
    drop = draw(_rarely(st.integers(0, len(headers) - 1)))
    headers = [h for i, h in enumerate(headers) if i != drop]
    lines = ["From 0 Mon Sep 17 00:00:00 2001", "Subject: [PATCH] fuzz", "", *headers, "---", ""]
    for section in draw(st.lists(_file_section(), min_size=1, max_size=3)):
        lines += section
    lines += draw(st.sampled_from([[], ["-- ", "2.40"]]))
    eol = draw(_rarely(st.just("\r\n"), "\n"))
    data = bytearray((eol.join(lines) + eol).encode())
    damage = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=3)
    for where, value in draw(_rarely(damage, [])):
        data[int(where * len(data))] = value
    return bytes(data)


PATCH_INPUTS = st.one_of(patch_texts(), patch_texts(), st.binary(max_size=2000), *[patch_texts()] * 3)


def check_patch(data: bytes) -> None:
    """Parse or SeriesError; apply, conflict or BundleError; nothing on disk changes."""
    TRIED["patch parser+applier"] += 1
    with _workspace() as base:
        tree = base / "tree"
        make_tree(tree, base / "outside")
        patches = base / "patches"
        patches.mkdir()
        (patches / "0001-fuzz.patch").write_bytes(data)
        (patches / "series").write_text("0001-fuzz.patch\n")
        before = snapshot(base)
        try:
            _parse_and_apply(patches / "series", tree)
        except Finding:
            raise
        except Exception as exc:
            raise Finding("traceback", f"{type(exc).__name__}: {exc}") from exc
        changed = _diff(before, snapshot(base))
        if changed:
            raise Finding("outside", "; ".join(changed[:5]))


def _parse_and_apply(series_file: Path, tree: Path) -> None:
    try:
        series = load_series(series_file)
    except BundleError:
        OUTCOMES["patch parser+applier", "refused by the parser"] += 1
        return
    for fuzz in (0, 2):
        for reverse in (False, True):
            virtual = VirtualTree(tree)
            for fp in series.patches[0].files:
                try:
                    apply_file_patch(virtual, fp.reversed() if reverse else fp, fuzz)
                    OUTCOMES["patch parser+applier", "file patch applied"] += 1
                except HunkFailure:
                    OUTCOMES["patch parser+applier", "file patch conflict"] += 1
                except BundleError:
                    OUTCOMES["patch parser+applier", "file patch refused by the applier"] += 1
            real_tree = os.path.realpath(tree)
            for path, text in virtual.changed().items():
                where = os.path.realpath(tree / path)  # a writer would follow symlinks in the tree
                if (
                    path.startswith("/")
                    or ".." in path.split("/")
                    or os.path.commonpath([where, real_tree]) != real_tree
                ):
                    raise Finding("outside", f"the applier produced an edit for {path!r}, which is {where}")
                if text is not None:
                    text.to_bytes()  # what the writers call next


# ---------------------------------------------------------------- configs

# Bounds for one config: the tool reads a few KiB into a dozen dataclasses, so a document
# that takes longer or more memory than this is a finding (a 'hang' or 'memory'), whatever
# it holds. scripts/fuzz runs under its own, wider, address-space limit as well.
CONFIG_SECONDS = 2.0
CONFIG_MEMORY = 512 << 20


@functools.lru_cache(maxsize=1)
def _schema() -> dict:
    from sm12x_bundle import config as config_mod

    return yaml.safe_load(config_mod.default_text())


def _maybe(draw, strategy, otherwise=None):
    """``_rarely`` inside a composite: one draw of an integer instead of a flatmap (the
    schema has a few hundred places, and flatmap is slow)."""
    return draw(strategy) if draw(st.integers(0, 23)) == 12 else otherwise


_ODD_SCALARS = [
    "", "0.21.0", "0.33.0", "latest", "/abs/path", "../escape", "~", "a b", "x" * 300, "\u00e9", "\ufeff",
    "sha256:" + "0" * 64, "0" * 64, "${meta.gpu_pool}", "--port=1", "yes", "no", "null", "~/x", ".nan", "0o17",
    "0x1F", "1e400", "-.inf", "2026-11-25", "12:30:00", "<<",
]  # fmt: skip
_SCALAR = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=20),
    st.sampled_from(_ODD_SCALARS),
)
_VALUE = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
_KEYS = st.sampled_from(["pin", "lanes", "series", "check", "output", "targets", "image", "jobs", "version",
                         "sha256", "name", "port", "gpus", "env", "prot", "jbos", "x-extra", ""])  # fmt: skip


def _around(draw, value):
    """``value`` from the real schema, kept mostly whole: a key dropped, a value replaced, an
    unknown key added, a list cut or repeated, each rarely, so most documents get past the
    first check and reach the value checks behind it."""
    if isinstance(value, dict):
        out = {}
        for key, inner in value.items():
            if not _maybe(draw, st.just(True), False):  # else the key is dropped
                out[key] = _around(draw, inner)
        for key, inner in _maybe(draw, st.lists(st.tuples(_KEYS, _VALUE), max_size=2), []):
            out.setdefault(key, inner)
        return out
    if isinstance(value, list):
        items = [_around(draw, v) for v in value]
        cut = _maybe(draw, st.integers(0, len(items)), len(items))
        return items[:cut] + _maybe(draw, st.lists(st.sampled_from(items or [None]), max_size=3), [])
    return _maybe(draw, _VALUE, value)


def _bomb(levels: int, width: int) -> str:
    lines = [f"x0: &x0 [{', '.join(['lol'] * width)}]"]
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


_TEXT_DAMAGE = st.sampled_from([
    lambda t, n: _bomb(min(n, 9), 9) + t,                                   # an alias bomb beside the settings
    lambda t, n: t.replace("fuzz: 0", "fuzz: &f 0\n  versions: *f", 1),    # one anchor, one alias
    lambda t, n: t.replace("check:", "check: &c\n  fuzz: 1\nx: {<<: *c}\nz:", 1),  # a merge key
    lambda t, n: "[" * n * 50 + "]" * n * 50 + "\n",                        # deep flow lists
    lambda t, n: "{a: " * n * 50 + "}" * n * 50 + "\n",                     # deep flow mappings
    lambda t, n: "".join(f"{'  ' * i}k{i}:\n" for i in range(n * 8)),       # deep block mappings
    lambda t, n: t.replace("fuzz: 0", "fuzz: " + "9" * (n * 1000), 1),      # a huge number
    lambda t, n: t + "x-big: " + "x" * (n * 10_000) + "\n",                 # a long scalar
    lambda t, n: t + "# " + "." * (n * 200_000) + "\n",                     # a huge comment (size alone)
    lambda t, n: "",                                                        # empty
    lambda t, n: "# only a comment\n",
    lambda t, n: "{}\n",
    lambda t, n: t + "---\n" + t,                                           # two documents
    lambda t, n: "%YAML 1.1\n%TAG ! tag:x,2026:\n---\n" + t,                 # directives
    lambda t, n: t.replace("fuzz: 0", "fuzz: !!python/object/apply:os.system ['true']", 1),
    lambda t, n: t.replace("fuzz: 0", "fuzz: !!binary aGk=", 1),
    lambda t, n: t.replace("fuzz: 0", "fuzz: !custom 0", 1),
    lambda t, n: t.replace("fuzz: 0", "fuzz: 0\nfuzz: 1", 1),               # a duplicate key
    lambda t, n: t.replace("  ", "\t", 1),                                   # a tab in the indentation
    lambda t, n: t[: len(t) * n // 10],                                      # cut short
])  # fmt: skip
_BYTE_DAMAGE = st.sampled_from([
    lambda b: b.replace(b"check", "ch\u00e9ck".encode("latin-1"), 1),        # latin-1, not UTF-8
    lambda b: b.decode("utf-8", "replace").encode("utf-16"),                 # UTF-16 with its BOM
    lambda b: b"\xef\xbb\xbf" + b,                                           # a UTF-8 BOM
    lambda b: b + b"\xff\xfe\x00",
    lambda b: b.replace(b"0", b"\x00", 1),                                   # a NUL byte
    lambda b: b.replace(b"e", b"\xc3\x28", 1),                               # a broken sequence
])  # fmt: skip


@st.composite
def config_documents(draw) -> bytes:
    """A YAML config around the real schema (src/sm12x_bundle/data/default.yaml), then maybe
    one text-level hostility (aliases, nesting, size, tags, documents), then maybe damage
    at the byte level; about one in twenty is raw bytes."""
    if _maybe(draw, st.just(True), False):
        return draw(st.binary(max_size=2000))
    text = yaml.dump(_around(draw, _schema()), Dumper=_DUMPER, sort_keys=False, allow_unicode=True)
    if draw(st.integers(0, 3)) == 0:  # hostility is the point here: one document in four
        damage, n = draw(_TEXT_DAMAGE), draw(st.integers(1, 10))
        text = damage(text, n)
    data = text.encode("utf-8", "surrogateescape")
    hurt = _maybe(draw, _BYTE_DAMAGE)
    return hurt(data) if hurt else data


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's, where PyYAML has it: faster
CONFIG_INPUTS = config_documents()


@contextmanager
def bounded(seconds: float, memory: int):
    """Run the block under a time limit (SIGALRM: Finding 'hang') and an address-space limit
    ``memory`` bytes above what the process holds now (MemoryError: Finding 'memory').
    An outer alarm (scripts/fuzz's) and the old limit are put back afterwards."""
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_started = time.monotonic()

    def hang(*_):
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # again soon, should this one be swallowed (a __del__, gc)
        raise Finding("hang", f"one config took more than {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, hang)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    cap = in_use + memory if hard == resource.RLIM_INFINITY else min(in_use + memory, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except MemoryError:
        raise Finding("memory", f"one config took more than {memory >> 20} MiB") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, old_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer_left - (time.monotonic() - outer_started)))


def check_config(data: bytes) -> None:
    """``config.load`` returns a Config or raises ConfigError, within CONFIG_SECONDS and
    CONFIG_MEMORY; nothing on disk changes."""
    from sm12x_bundle import config as config_mod
    from sm12x_bundle.errors import ConfigError

    TRIED["config loader"] += 1
    with _workspace() as base:
        path = base / "sm12x-bundle.yaml"
        path.write_bytes(data)
        before = snapshot(base)
        try:
            with bounded(CONFIG_SECONDS, CONFIG_MEMORY):
                loaded = config_mod.load(path, base)
            OUTCOMES["config loader", "loaded"] += 1
            if not isinstance(loaded, config_mod.Config):
                raise Finding("traceback", f"load returned {type(loaded).__name__}, not a Config")
        except ConfigError as exc:
            OUTCOMES["config loader", _config_reason(str(exc))] += 1
        except Finding:
            raise
        except Exception as exc:
            raise Finding("traceback", f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        changed = _diff(before, snapshot(base))
        if changed:
            raise Finding("outside", "; ".join(changed[:5]))


def _config_reason(message: str) -> str:
    """The kind of a refusal, without the names in it."""
    for key in (
        "anchors and aliases", "alias", "nested", "UTF-8", "larger than", "no settings", "not valid YAML",
        "duplicate key", "unknown key", "keys must be strings", "tag", "must be a mapping", "must be a list",
        "needs", "must be", "does not exist", "unique", "is below every lane",
    ):  # fmt: skip
        if key in message:
            return "refused: " + key
    return "refused: other (" + message.split(": ", 2)[-1][:50] + ")"
