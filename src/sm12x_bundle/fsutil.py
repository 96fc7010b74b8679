"""Writing outputs so that a failure leaves nothing half-written, reruns change nothing,
and nothing the tool did not write is ever replaced.

Every folder the tool owns carries :data:`MARKER`. A folder is replaced only when it is
absent, empty or marked (or ``--force`` says so); the working directory, the home
folder, the root, the system's top-level folders, the folders above the working directory
or the home folder, mount points and folders that hold one never are. A file is written
only as a new file or over a regular file: a device, FIFO, socket or folder at its path
is refused. What the machine refuses (a read-only or full file system, permissions) is
:class:`EnvironmentProblem`, one sentence naming the path and the system's words.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import EnvironmentProblem, OutputError, environment_problem, is_environment

MARKER = ".sm12x-bundle-output"
MARKER_TEXT = (
    b"This folder was written by sm12x-bundle: its next run may replace the folder or the files in it.\n"
    b"Delete this file to keep sm12x-bundle from doing so without --force.\n"
)
# A fixed mtime (2000-01-01), so that reruns leave the same bytes and the same mtimes.
MARKER_MTIME = 946684800
_STAGING_KINDS = ("new", "old")


def write_file(path: Path, data: bytes, mode: int = 0o644, what: str = "file") -> bool:
    """Write atomically, and only when the content changes (keeps mtimes and caches stable).
    Only a new file or a regular file is written (OutputError for anything else at the
    path); a write the machine refuses is EnvironmentProblem."""
    refuse_special_file(path, what)
    try:
        return _write_file(path, data, mode)
    except OSError as exc:
        raise environment_problem(exc, f"write the {what} {path}") from None


def _write_file(path: Path, data: bytes, mode: int) -> bool:
    if path.is_file() and path.read_bytes() == data:
        if (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


# --- what stands at a path --------------------------------------------------------------

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (a named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)
# File systems that hold the kernel's views, not files: nothing of ours is ever written there.
PSEUDO_FILE_SYSTEMS = frozenset({
    "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore", "bpf", "configfs",
    "efivarfs", "fusectl", "devpts", "mqueue", "binfmt_misc", "autofs", "nsfs", "rpc_pipefs",
})


def kind_of(path: str | os.PathLike[str], follow: bool = True) -> str | None:
    """What stands at ``path`` when it is not a regular file ('a folder', 'a character
    device', ...); None for a regular file or nothing (a dangling link is nothing)."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise environment_problem(exc, f"look at {os.fspath(path)}") from None
    return next((kind for test, kind in _KINDS if test(mode)), None)


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """'is a character device', 'is a link to a FIFO (a named pipe) (/x/f)' when ``path`` is
    not a regular file, a link to one or nothing; else None."""
    kind = kind_of(path)
    if kind is None:
        return None
    return f"is a link to {kind} ({os.path.realpath(path)})" if os.path.islink(path) else f"is {kind}"


def refuse_special_file(path: str | os.PathLike[str], what: str = "file") -> None:
    """A file is written only as a new file or over a regular file (links followed): a
    device, FIFO, socket or folder at ``path`` is refused (OutputError), even as root."""
    problem = not_a_file(path)
    if problem:
        raise OutputError(
            f"the {what} {os.fspath(path)} {problem}, not a regular file: refused; name a new file or a regular one"
        )


def _mounts() -> list[tuple[int, str, str]]:
    """(device number, mount point, file system type) of each mount this process sees."""
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:  # not Linux, or no /proc: the st_dev test below still holds
        return []
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields[6:] or len(fields) < 5:
            continue
        major, minor = (int(n) for n in fields[2].split(":"))
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        mounts.append((os.makedev(major, minor), point, fields[fields.index("-", 6) + 1]))
    return mounts


def file_system_type(folder: Path) -> str | None:
    """The type of the file system ``folder`` is on ('ext4', 'proc', ...), when the system says."""
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return None
    return next((kind for number, _point, kind in _mounts() if number == dev), None)


def pseudo_file_system(folder: Path) -> str | None:
    """The kernel file system ``folder`` is on ('proc', 'sysfs'), or None for a real one."""
    kind = file_system_type(folder)
    return kind if kind in PSEUDO_FILE_SYSTEMS else None


def is_mount_point(path: Path) -> bool:
    """A mount point: on another device than its parent (os.path.ismount), or mounted there
    from the same device (a bind mount, which only the mount table shows)."""
    if os.path.ismount(path):
        return True
    real = os.path.realpath(path)
    return any(point == real for _dev, point, _kind in _mounts())


def mount_points_below(folder: Path) -> list[str]:
    """The mount points inside ``folder`` (moving or deleting it would reach into them)."""
    real = os.path.realpath(folder).rstrip("/") + "/"
    return sorted({point for _dev, point, _kind in _mounts() if point.startswith(real)})


# --- which folders may be written ------------------------------------------------------


def is_ours(folder: Path) -> bool:
    """The folder holds the marker this tool writes into every folder it owns."""
    marker = folder / MARKER
    return marker.is_file() and not marker.is_symlink()


# The system's own top-level folders (and, merged into /usr on most systems, /usr's own):
# an output folder is a folder of its own, never one of these.
SYSTEM_FOLDERS = frozenset({
    "bin", "boot", "dev", "etc", "home", "lost+found", "media", "mnt", "opt", "proc", "root", "run", "sbin",
    "snap", "srv", "sys", "tmp", "usr", "var",
})


def _system_folder(path: Path) -> bool:
    """/etc, /usr, /lib64 ... and /usr/lib, /usr/bin ... (the path as given, or resolved)."""
    top = path.parent == Path(path.anchor) and (path.name in SYSTEM_FOLDERS or path.name.startswith("lib"))
    return top or path.parent == Path(path.anchor) / "usr"


def refuse_protected(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """Refuse '', the working directory, home, the root, the system's top-level folders and
    the folders above the working directory or home (even with --force); return the path as given."""
    raw = os.fspath(path)
    try:
        target = Path(raw).resolve()
    except (RuntimeError, OSError):  # RuntimeError: pathlib's word for ELOOP before Python 3.13
        raise OutputError(f"the {what} {raw!r} goes through a loop of symbolic links: refused; "
                          "name a folder whose path resolves") from None
    cwd = Path.cwd().resolve()
    if raw.strip() == "":
        where = "an empty path"
    elif target == Path(target.anchor):
        where = "the root folder"
    elif Path.home().resolve() in (target, Path(os.path.expanduser(raw)).resolve()):
        where = "the home folder"
    elif target in Path.home().resolve().parents:
        where = "a folder above the home folder"
    elif target == cwd:
        where = "the working directory"
    elif target in cwd.parents:
        where = "a folder above the working directory"
    elif _system_folder(target) or _system_folder(Path(os.path.abspath(raw))):
        where = "a system folder"
    else:
        return Path(raw)
    raise OutputError(f"the {what} {raw!r} is {where}: refused, even with --force; name a folder of its own")


# Folders whose contents the system and its services own: --force never replaces a folder
# inside one (/var/lib/docker, /usr/local/lib, /etc/ssl). /opt, /srv, /mnt and /tmp are where
# operators put things of their own, so a folder inside them may be forced.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/proc", "/root", "/run", "/sbin", "/sys", "/usr", "/var/lib",
                "/var/log", "/var/run", "/var/spool")


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _home_folders() -> list[Path]:
    """This user's home folder and every folder in /home (each somebody's home)."""
    homes = [Path.home().resolve()]
    with contextlib.suppress(OSError):
        homes += [p.resolve() for p in Path("/home").iterdir() if p.is_dir()]
    return homes


def forced_problem(target: Path) -> str | None:
    """Why --force must not replace the (resolved) folder ``target``, in words after 'is';
    None: it may. A folder inside a system folder, a home folder or one of its dot folders
    (~/.ssh, ~/.config and all inside them): what they hold is never the tool's to delete."""
    for home in _home_folders():
        if target == home:
            return "a home folder"
        if home in target.parents and target.relative_to(home).parts[0].startswith("."):
            return f"inside the dot folder {home / target.relative_to(home).parts[0]}"
    for folder in SYSTEM_TREES:
        if _under(target, Path(folder)) and not _under(target, Path.home().resolve()):  # root's home is /root
            return f"inside the system folder {folder}"
    if target.parent == Path(target.anchor) and target.name.startswith("lib"):
        return f"the system folder {target}"
    if len(target.parts) > 1 and target.parts[1].startswith("lib") and target.parent != Path(target.anchor):
        return f"inside the system folder /{target.parts[1]}"
    return None


def refuse_overlap(output: Path, inputs: Iterable[tuple[str, Path | None]], what: str = "output folder") -> None:
    """An output inside a folder the run reads (the cache, a source tree, the series folder)
    would be copied into itself, and an input inside the output is deleted by replacing it:
    both are refused before anything is written (OutputError), naming both paths."""
    out = Path(os.path.realpath(output))
    for name, path in inputs:
        if path is None:
            continue
        src = Path(os.path.realpath(path))
        if _under(out, src):
            raise OutputError(f"the {what} {output} is inside the {name} {path}, which this run reads: refused; "
                              "choose a folder outside it")
        if _under(src, out):
            raise OutputError(f"the {name} {path}, which this run reads, is inside the {what} {output}: refused; "
                              "choose another folder")


def _first_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_parent(dest: Path, what: str) -> None:
    """Every existing folder on the way to ``dest`` must be a folder (a sentence, not a
    traceback), on a file system that holds files (not /proc or /sys)."""
    above = _first_existing(dest.absolute().parent)
    if not above.is_dir():
        raise OutputError(f"cannot write the {what} {dest}: {above} is a file, not a folder; choose another path")
    kernel = pseudo_file_system(above)
    if kernel:
        raise EnvironmentProblem(
            f"cannot write the {what} {dest}: {above} is on the kernel's {kernel} file system, which holds "
            "no files of ours; choose another path"
        )


def check_replaceable(dest: Path, force: bool = False, what: str = "output folder") -> None:
    """Refuse to replace ``dest`` unless it is absent, empty, a previous output of this tool
    (marked), or ``force``; nothing is written either way. A mount point, a folder that holds
    one, a device, FIFO or socket is refused even with ``force``: it cannot be moved aside."""
    refuse_protected(dest, what)
    check_parent(dest, what)
    if not os.path.lexists(dest):
        return
    _refuse_immovable(dest, what)
    if force:
        problem = forced_problem(Path(os.path.realpath(dest.absolute().parent)) / dest.name)
        if problem:
            raise OutputError(f"the {what} {dest} is {problem}: refused, even with --force; name a folder of its own")
        return
    if dest.is_symlink() or not dest.is_dir():
        raise OutputError(
            f"the {what} {dest} exists and is not a folder this tool wrote: refused; "
            "remove it, choose another path, or pass --force to replace it"
        )
    if is_ours(dest):
        return
    foreign = sorted(p.name for p in dest.iterdir())
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"the {what} {dest} holds files this tool did not write ({shown}): refused; empty it, "
            "choose another path, or pass --force to replace it"
        )


def _refuse_immovable(dest: Path, what: str) -> None:
    """What replacing ``dest`` (moving it aside, then deleting it) must never touch."""
    kind = kind_of(dest, follow=False)
    if kind not in (None, "a folder"):
        problem = f"is {kind}"
    elif dest.is_symlink():
        return  # the link itself is moved aside, never what it points to
    elif is_mount_point(dest):
        problem = "is a mount point"
    else:
        inside = mount_points_below(dest) if kind == "a folder" else []
        if not inside:
            return
        problem = f"holds a mount point ({inside[0]})"
    raise OutputError(f"the {what} {dest} {problem}: refused, even with --force; name a folder of its own")


def check_files(
    folder: Path, files: Mapping[str, bytes | None], force: bool = False, what: str = "output folder"
) -> None:
    """A folder the tool writes single files into (never replaced whole): refuse to
    overwrite a file with other bytes unless the folder is ours or ``force``. New files
    beside someone else's destroy nothing, so they are written. (None: bytes not known
    yet, so any file of that name would be overwritten.)"""
    refuse_protected(folder, what)
    check_parent(folder / "x", what)
    if os.path.lexists(folder) and not folder.is_dir():
        raise OutputError(f"the {what} {folder} is a file, not a folder: refused; choose another path")
    for name in files:  # a device, FIFO or socket is never written over, even with force
        refuse_special_file(folder / name, f"file of the {what}")
    if force or is_ours(folder):
        return
    clobbered = [n for n, data in files.items() if os.path.lexists(folder / n) and not _holds(folder / n, data)]
    if clobbered:
        raise OutputError(
            f"the {what} {folder} is not marked as written by this tool and {', '.join(clobbered)} would be "
            "overwritten with other bytes: refused; move them away, choose another path, or pass --force"
        )


def _holds(path: Path, data: bytes | None) -> bool:
    try:
        return data is not None and path.is_file() and not path.is_symlink() and path.read_bytes() == data
    except OSError:
        return False


@dataclass(frozen=True)
class Earlier:
    """What an earlier version of this tool left in a folder it writes into, before it marked
    its folders: the files named ``files``, and folders whose names match ``folders`` each
    holding the file ``holding``. Data, not a callback, so that the rule lives here."""

    files: tuple[str, ...] = ()
    folders: str = r"(?!)"
    holding: str = ""

    def left_only(self, folder: Path) -> bool:
        """``folder`` holds something, and only what an earlier version left."""
        entries = list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
        return bool(entries) and all(
            (p.name in self.files and p.is_file())
            or (re.fullmatch(self.folders, p.name) is not None and (p / self.holding).is_file())
            for p in entries
        )


def check_into(folder: Path, force: bool, what: str, earlier: Earlier | None = None) -> None:
    """A folder the tool writes folders of its own into (an overlay target's): like
    check_replaceable, but a folder holding only what an earlier version of this tool wrote
    there before it marked its folders (``earlier``) is taken as ours."""
    if not force and folder.is_dir() and not is_ours(folder) and earlier is not None and earlier.left_only(folder):
        return
    check_replaceable(folder, force, what)


@dataclass(frozen=True)
class Destination:
    """A path an output writes, and how, so that it is refused before anything runs.

    ``replace``: a folder replaced whole (the patched tree, an overlay version, a build
    context); ``into``: a folder written into, folder by folder (an overlay target's);
    ``files``: single files written into a folder never replaced whole (the Nomad specs);
    ``within``: a folder only written below, by the destinations inside it (the overlays
    folder): refused only where nothing may be written (the root, home, system folders).
    ``files`` names the single files (for ``into``, those it writes beside its folders)."""

    path: Path
    how: str
    what: str
    files: tuple[str, ...] = ()
    earlier: Earlier | None = None

    def check(self, force: bool = False) -> None:
        if self.how == "within":  # a folder only written below (the overlays folder)
            refuse_protected(self.path, self.what)
        elif self.how == "replace":
            check_replaceable(self.path, force, self.what)
        elif self.how == "files":
            check_files(self.path, dict.fromkeys(self.files), force, self.what)
        elif self.how == "into":
            check_into(self.path, force, self.what, self.earlier)
            for name in self.files:  # its own files beside the folders: never a device, FIFO or socket
                refuse_special_file(self.path / name, f"file of the {self.what}")
        else:
            raise ValueError(f"unknown destination kind {self.how!r}")


def check_destinations(destinations: Iterable[Destination], force: bool = False) -> None:
    """Refuse, before anything is read, built or written, any destination this run may not write."""
    for destination in destinations:
        destination.check(force)


def mark(folder: Path) -> None:
    """Write the marker that says ``folder`` is this tool's to replace."""
    write_file(folder / MARKER, MARKER_TEXT)
    os.utime(folder / MARKER, (MARKER_MTIME, MARKER_MTIME))


def claim(folder: Path, what: str = "output folder") -> None:
    """Create ``folder`` if needed and mark it ours when it is empty (a forced write into
    someone else's folder leaves it unmarked)."""
    _mkdir(folder, what)
    if not any(folder.iterdir()):
        mark(folder)


@dataclass(frozen=True)
class FileSpec:
    """One file an output writes: where (relative), its bytes, its mode and its mtime."""

    path: str
    data: bytes
    mode: int
    mtime: int


@dataclass(frozen=True)
class Version:
    """A folder replaced whole (an overlay version) inside a folder written into."""

    folder: Path
    files: tuple[FileSpec, ...]


def holds(folder: Path, files: Iterable[FileSpec]) -> bool:
    """``folder`` (0755) already holds these files, bytes and modes: it is left alone, inodes
    and all (a folder an older version left 0700 is written again)."""
    try:
        if _mode(folder) != 0o755:
            return False
        return all((folder / f.path).read_bytes() == f.data and _mode(folder / f.path) == f.mode for f in files)
    except OSError:
        return False


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _put(folder: Path, files: Iterable[FileSpec]) -> None:
    """Write ``files`` into a fresh staging ``folder``; every folder 0755, as vLLM's own are in
    an image (the staging folder starts private, 0700, and must be readable in a container)."""
    for f in files:
        dest = folder / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.data)
        os.chmod(dest, f.mode)
        os.utime(dest, (f.mtime, f.mtime))
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        os.chmod(sub, 0o755)


def write_versions(
    into: Iterable[Destination],
    versions: Iterable[Version],
    pointers: Iterable[tuple[Path, FileSpec]],
    force: bool = False,
    check: Callable[[int, Path], None] | None = None,
    what: str = "output folder",
) -> None:
    """Write version folders (each a ``what``) into the folders ``into``, then the pointer files beside them.

    Every destination is refused first. Each version folder that does not already hold its
    files is staged; ``check(i, staged)`` may refuse the i-th (an overlay verified in its
    image) before anything moves. Then the staged folders take their places, the folders
    ``into`` that held nothing or only what an earlier version left are marked ours, and each
    pointer file (current.json) is written. On any error nothing is written: staging folders
    are removed and the pointers keep pointing where they did."""
    into, versions = list(into), list(versions)
    fresh = [not holds(v.folder, v.files) for v in versions]
    check_destinations(into + [Destination(v.folder, "replace", what) for v, new in zip(versions, fresh) if new], force)
    claimed = [d.path for d in into if d.how == "into" and _claimable(d)]
    for destination in into:
        if destination.how == "into":
            readable_folders(destination.path, destination.what)
    with contextlib.ExitStack() as stack:
        for i, (version, new) in enumerate(zip(versions, fresh)):
            folder = version.folder
            if new:
                folder = stack.enter_context(replace_dir(version.folder, force, what))
                _put(folder, version.files)
            if check is not None:
                check(i, folder)
    for folder in claimed:
        mark(folder)
    for path, spec in pointers:
        write_file(path, spec.data)
        os.utime(path, (spec.mtime, spec.mtime))


def readable_folders(folder: Path, what: str) -> None:
    """Create ``folder`` and the folders above it that are missing, each 0755 whatever the
    umask (a container's user reads overlays through them); a folder of ours already there
    is made 0755 too, one of someone else's is left as it is."""
    missing = []
    above = folder.absolute()
    while not os.path.lexists(above) and above != above.parent:
        missing.append(above)
        above = above.parent
    try:
        for path in reversed(missing):
            path.mkdir(exist_ok=True)
            os.chmod(path, 0o755)
        if is_ours(folder) and _mode(folder) != 0o755:
            os.chmod(folder, 0o755)
    except OSError as exc:
        raise environment_problem(exc, f"create the {what} {folder}") from None


def _claimable(destination: Destination) -> bool:
    """Absent, empty, or holding only what an earlier version left: marked ours once written."""
    folder, earlier = destination.path, destination.earlier
    return not (folder.is_dir() and any(folder.iterdir())) or (earlier is not None and earlier.left_only(folder))


def write_files(folder: Path, files: Mapping[str, bytes], force: bool = False, what: str = "output folder") -> list[tuple[Path, bool]]:
    """Check every file first, then write each atomically; return (path, changed) pairs."""
    check_files(folder, files, force, what)
    claim(folder, what)
    return [(folder / name, write_file(folder / name, data)) for name, data in files.items()]


def _mkdir(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise environment_problem(exc, f"create the {what} {folder}") from None


# --- replacing a folder whole -----------------------------------------------------------


# Folders this process holds a lock on, by (device, inode), with how many blocks hold it.
# flock locks belong to an open file, not to the process: a second flock on the same folder
# through another fd of this process would wait for itself forever (a context written
# inside a locked scratch folder swaps itself in under a lock on that folder).
_HELD: dict[tuple[int, int], int] = {}


def _lock(folder: Path) -> int:
    """Hold an exclusive flock on ``folder`` until ``_unlock`` (or the process dies); a folder
    this process already holds is taken again at once."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    key = _folder_key(fd)
    if key not in _HELD:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
    _HELD[key] = _HELD.get(key, 0) + 1
    return fd


def _unlock(fd: int) -> None:
    key = _folder_key(fd)
    _HELD[key] -= 1
    if not _HELD[key]:
        del _HELD[key]
    os.close(fd)  # the last holder's close releases the flock


def _folder_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _new_staging(parent: Path, name: str, kind: str) -> tuple[Path, int]:
    """A staging folder, locked while this run uses it and marked ours (in that order, so
    a cleaner never takes a live one for a leftover). Nothing is left when this fails."""
    path = Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-", dir=parent))
    fd = -1
    try:
        fd = _lock(path)
        mark(path)
    except BaseException:
        if fd >= 0:
            _unlock(fd)
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def remove_leftovers(dest: Path, kinds: tuple[str, ...] = _STAGING_KINDS) -> list[Path]:
    """Remove staging folders of ``dest`` left by a run that died: ours (marked) and
    locked by no live run. Return what was removed."""
    removed = []
    for kind in kinds:
        for path in dest.parent.glob(f".{dest.name}.{kind}-*"):
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.geteuid():
                continue  # another user's (a shared temp folder): never ours to remove
            if not is_ours(path):  # made, then killed before its marker: empty, so rmdir is safe
                with contextlib.suppress(OSError):
                    path.rmdir()
                    removed.append(path)
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a concurrent run is using it
            try:
                discard(path)
                removed.append(path)
            finally:
                os.close(fd)
    return removed


@contextlib.contextmanager
def replace_dir(dest: Path, force: bool = False, what: str = "output folder") -> Iterator[Path]:
    """Yield a fresh staging folder beside ``dest``; on success it becomes ``dest``.

    ``dest`` must be absent, empty or a previous output (else OutputError, unless
    ``force``). On any error the staging folder is removed and ``dest`` is left as it was;
    what the machine refuses (a full or read-only file system) is EnvironmentProblem.
    The staging folder holds the marker, so ``dest`` ends up marked.
    """
    check_replaceable(dest, force, what)
    shown, dest = dest, dest.absolute()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise environment_problem(exc, f"write the {what} {shown}") from None
    remove_leftovers(dest)
    try:
        staging, fd = _new_staging(dest.parent, dest.name, "new")
    except OSError as exc:  # the staging folder was never made: name the folder it goes in
        exc.filename = os.fspath(dest.parent)
        raise environment_problem(exc, f"write the {what} {shown}") from None
    try:
        yield staging
        _swap(staging, dest)
    except OSError as exc:
        if not (is_environment(exc) or isinstance(exc, shutil.Error)):
            raise
        raise environment_problem(_as_in(exc, staging, shown), f"write the {what} {shown}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        _unlock(fd)


def _as_in(exc: OSError, staging: Path, dest: Path) -> OSError:
    """The error naming its file where it would be in ``dest``, not in the staging folder."""
    for attr in ("filename", "filename2"):
        name = getattr(exc, attr, None)
        if name is not None and os.fspath(name).startswith(os.fspath(staging)):
            setattr(exc, attr, os.fspath(dest) + os.fspath(name)[len(os.fspath(staging)):])
    return exc


def copy_tree(src: Path, dest: Path) -> None:
    """Copy ``src`` into the folder ``dest`` (links as links), stopping at the first file
    that cannot be written: a full disk is one error, not one per remaining file."""

    def copy(a: str, b: str) -> None:
        try:
            shutil.copy2(a, b)
        except OSError as exc:  # named by the file that could not be written, not the one read
            raise _CopyStopped(OSError(exc.errno, exc.strerror, b)) from None

    try:
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True, copy_function=copy)
    except _CopyStopped as stopped:
        raise stopped.error from None


class _CopyStopped(Exception):
    """Not an OSError, so that shutil.copytree stops instead of collecting one per file."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _swap(staging: Path, dest: Path) -> None:
    """Move ``staging`` into place; concurrent runs take turns (a lock on the parent), so
    that one never finds ``dest`` moved aside by the other."""
    parent = _lock(dest.parent)
    try:
        _swap_locked(staging, dest)
    finally:
        _unlock(parent)


def _swap_locked(staging: Path, dest: Path) -> None:
    """Two renames; when either fails (a busy, read-only or other file system), ``dest`` is
    put back and the folder it was set aside in removed, so nothing is left behind."""
    if not (dest.exists() or dest.is_symlink()):
        os.replace(staging, dest)
        return
    old, fd = _new_staging(dest.parent, dest.name, "old")
    try:
        try:
            os.replace(dest, old / "x")
        except OSError:
            shutil.rmtree(old, ignore_errors=True)
            raise
        try:
            os.replace(staging, dest)
        except OSError:
            os.replace(old / "x", dest)
            shutil.rmtree(old, ignore_errors=True)
            raise
        discard(old)
    finally:
        _unlock(fd)


def discard(folder: Path) -> None:
    """Delete a marked leftover folder, its marker last: a run killed while deleting it leaves
    it marked, so the next run knows it for its own and finishes the job."""
    for entry in list(folder.iterdir()):
        if entry.name == MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
    pause("leftover-deleting")
    shutil.rmtree(folder, ignore_errors=True)


# For the tests only: SM12X_TEST_PAUSE_AT=<point> makes the run write its pid to
# $SM12X_TEST_PAUSE_FILE and sleep at that point, so a test can kill it there (SIGKILL).
# Unset (always, outside the tests), it does nothing.
def pause(point: str) -> None:
    if os.environ.get("SM12X_TEST_PAUSE_AT") != point:
        return
    Path(os.environ["SM12X_TEST_PAUSE_FILE"]).write_text(f"{os.getpid()}\n")
    time.sleep(60)


# --- scratch folders in $TMPDIR ---------------------------------------------------------


@contextlib.contextmanager
def temp_folder(prefix: str) -> Iterator[str]:
    """A scratch folder in the temp folder, removed when the block ends (an exception,
    Ctrl-C or SIGTERM included: cli.main turns SIGTERM into KeyboardInterrupt). It is locked
    and marked while in use, so a run killed with SIGKILL leaves a folder the next run that
    asks for one of the same ``prefix`` removes (remove_dead_temps)."""
    remove_dead_temps(prefix)
    parent = Path(tempfile.gettempdir())  # none usable: cli.main says so (exit 12)
    path, fd = _new_staging(parent, prefix.rstrip("-"), "tmp")
    try:
        pause("scratch-folder")
        yield os.fspath(path)
    finally:
        discard(path)
        _unlock(fd)


def remove_dead_temps(prefix: str) -> list[Path]:
    """Remove scratch folders of ``prefix`` that a killed run left in the temp folder:
    marked and locked by no live run."""
    try:
        parent = Path(tempfile.gettempdir())
    except OSError:  # no usable temp folder: temp_folder's own call says so
        return []
    return remove_leftovers(parent / prefix.rstrip("-"), kinds=("tmp",))
