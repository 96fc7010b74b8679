"""The tripwire of tests/test_hostile.py, loaded into every Python process a hostile case
starts (this folder is first on its PYTHONPATH, so Python imports this file at start-up).

It does nothing unless SM12X_HOSTILE_WRITABLE is set. Then, through an audit hook (PEP 578),
it stops the process before any change to the file system outside those folders: a file
opened for writing, a folder made, a rename, a removal, a link, a change of mode, owner or
times. The process writes one line naming the operation and the path to stderr and exits 86
at once, before the operation runs. So a case that names a real system path (/dev/full,
/etc with --force) cannot harm the machine even where the tool's own refusal is missing; the
canaries in the world judge everything inside it. Opening /dev/null without creating or
truncating it (what subprocess.DEVNULL does) is allowed. SM12X_HOSTILE_COMMANDS=1 allows
starting other programs (off by default: each is a finding), SM12X_HOSTILE_MEMORY caps the
address space (bytes), so a config that expands without end fails fast instead of taking
the machine's memory.
"""

import os
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
TRIPPED = 86


def _roots():
    return [os.path.realpath(p) for p in os.environ["SM12X_HOSTILE_WRITABLE"].split(os.pathsep) if p]


def _trip(event, path, why="outside the folders this case may change"):
    os.write(2, f"sm12x-hostile-guard: stopped {event} of {path!r}: {why}\n".encode())
    os._exit(TRIPPED)


def _absolute(path, dir_fd=None):
    path = os.fsdecode(path)
    if not os.path.isabs(path):
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd not in (None, -1) else os.getcwd()
        path = os.path.join(base, path)
    return path


def _entry(path, dir_fd=None):
    """Where a name lands (its folder resolved, the name itself not followed)."""
    path = _absolute(path, dir_fd)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _target(path, dir_fd=None):
    """What a path reaches (every link followed), or the file a descriptor is open on."""
    if isinstance(path, int):
        return os.readlink(f"/proc/self/fd/{path}")
    return os.path.realpath(_absolute(path, dir_fd))


def _open(args):
    path, _mode, flags = args
    if isinstance(path, int) or flags is None or not flags & _WRITE_FLAGS:
        return None
    if os.fsdecode(path) == os.devnull and not flags & (os.O_CREAT | os.O_TRUNC):
        return None
    return _target(path)


_WHERE = {  # event -> the paths it changes, from its audit arguments
    "open": lambda a: [_open(a)],
    "os.mkdir": lambda a: [_entry(a[0], a[2])],
    "os.rmdir": lambda a: [_entry(a[0], a[1])],
    "os.remove": lambda a: [_entry(a[0], a[1])],
    "os.rename": lambda a: [_entry(a[0], a[2]), _entry(a[1], a[3])],
    "os.symlink": lambda a: [_entry(a[1], a[2])],
    "os.link": lambda a: [_entry(a[1], a[3])],
    "os.chmod": lambda a: [_target(a[0], a[2])],
    "os.chown": lambda a: [_target(a[0], a[3])],
    "os.utime": lambda a: [_target(a[0], a[3])],
    "os.truncate": lambda a: [_target(a[0])],
    "os.setxattr": lambda a: [_target(a[0])],
    "os.removexattr": lambda a: [_target(a[0])],
    "shutil.rmtree": lambda a: [_entry(a[0], a[1] if len(a) > 1 else None)],
}
_COMMANDS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")


def _hook(event, args):
    where = _WHERE.get(event)
    if where is not None:
        for path in where(args):
            if path is not None and not any(path == r or path.startswith(r + os.sep) for r in ROOTS):
                _trip(event, path)
    elif event in _COMMANDS and os.environ.get("SM12X_HOSTILE_COMMANDS") != "1":
        _trip(event, str(args[0]), "this case may not start programs")


if os.environ.get("SM12X_HOSTILE_WRITABLE"):
    ROOTS = _roots()
    memory = os.environ.get("SM12X_HOSTILE_MEMORY")
    if memory:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    sys.addaudithook(_hook)
