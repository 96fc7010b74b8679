"""Dockerfile templates (docker/) and the build contexts rendered from them, in memory.

A template is rendered by :func:`render` only: each field between @ signs gets a value that
went through this module's quoting (:func:`shell_word`, :func:`label_word`, one-line text, a
:class:`Words` list continued over lines, or a :class:`Step` for a field alone on its line),
and the result is parsed back into instructions (:func:`parse`) and refused unless they are
the template's own, in order, with only the fields' values in them.

A context is ``{relative path: (bytes, mode)}`` until :func:`write_context` writes it
atomically with fixed mtimes (COPY keeps mtimes, so the same inputs give the same image
layers). Used by the native builder (native_build.py) and the bundle image (image.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..containers import Engine
from ..errors import ConfigError, VerifyError
from ..fsutil import replace_dir

# A build context in memory: relative path -> (bytes, mode). None: made by the builder.
ContextFiles = dict[str, tuple[bytes | None, int]]

# FROM names an image by reference, never by bare id: BuildKit (Docker's default builder
# since 23.0) reads `FROM sha256:<id>` as docker.io/library/sha256:<id> and fails, while
# the classic builder (the Docker SDK's) accepts it. A checked image is pinned instead by a
# local tag named after its id, which both builders resolve in the daemon's own store.
PIN_REPOSITORY = "sm12x-bundle-pin"
_IMAGE_ID = re.compile(r"sha256:([0-9a-f]{64})")


def from_reference(image: str) -> str:
    """What FROM says for ``image``: an id becomes its pin tag; a reference stays as it is."""
    m = _IMAGE_ID.fullmatch(image)
    return f"{PIN_REPOSITORY}:{m.group(1)}" if m else image


def pin_locally(engine: Engine, image: str) -> str:
    """Make :func:`from_reference`'s tag exist in the daemon (for an id); return the reference."""
    ref = from_reference(image)
    if ref != image:
        engine.tag(image, PIN_REPOSITORY, ref.split(":", 1)[1])
    return ref


def template(name: str) -> str:
    """docker/<name>: packaged with the tool (_docker/), or in the checkout."""
    packaged = resources.files("sm12x_bundle").joinpath(f"_docker/{name}")
    if packaged.is_file():
        return packaged.read_text("utf-8")
    checkout = Path(__file__).resolve().parents[3] / "docker" / name
    if checkout.is_file():
        return checkout.read_text("utf-8")
    raise ConfigError(f"docker/{name} not found: the tool is installed without its Dockerfiles")


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and its arguments, continued lines
    joined by one space."""

    keyword: str
    args: str


@dataclass(frozen=True)
class Words:
    """Words of one instruction, one per line (``\\`` continued): easier to read and diff."""

    items: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """The value of a field alone on its line: one instruction, or (keyword None) a comment."""

    keyword: str | None
    args: str | Words


FieldValue = str | Words | Step
_FIELD = re.compile(r"@([A-Z_]+)@")
_CONTINUED = " \\\n      "
# BuildKit reads "<<WORD" in RUN, COPY and ADD as a heredoc and takes the next lines as its body.
_HEREDOC = re.compile(r"<<-?[\"']?[A-Za-z_]")


def _one_line(value: str) -> str:
    if any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in value):
        raise ConfigError(f"a Dockerfile value cannot hold a control or line-separator character: {value!r}")
    return value


def shell_word(value: str) -> str:
    """One shell word that stays exactly ``value``, on one line."""
    return shlex.quote(_one_line(value))


def label_word(value: str) -> str:
    """A Dockerfile double-quoted word that stays exactly ``value`` (no $ expansion)."""
    return '"' + _one_line(value).replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _text(value: FieldValue, continued: str) -> str:
    if isinstance(value, Step):
        head = "#" if value.keyword is None else value.keyword
        return f"{head} {_text(value.args, continued)}"
    if isinstance(value, Words):
        return continued.join(_one_line(item) for item in value.items)
    return _one_line(value)


def fill(text: str, values: Mapping[str, FieldValue]) -> str:
    """Replace every field written between @ signs; refuse a field without a value."""
    missing = sorted(set(_FIELD.findall(text)) - set(values))
    if missing:
        raise ConfigError(f"Dockerfile template field(s) {', '.join(missing)} have no value")
    return _FIELD.sub(lambda m: _text(values[m.group(1)], _CONTINUED), text)


def render(name: str, values: Mapping[str, FieldValue]) -> str:
    """docker/<name> with its fields filled, parsed back and held to the template's instructions."""
    text = template(name)
    rendered = fill(text, values)
    expected = [i for i in (_expected(i, values) for i in parse(text)) if i is not None]
    found = parse(rendered)
    if found != expected:
        at = next((n for n, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
        raise VerifyError(
            f"the rendered {name} is not its template's {len(expected)} instructions with the values filled in "
            f"(it has {len(found)}; the first difference is instruction {at + 1}): a value changed its structure, refused"
        )
    return rendered


def _expected(template_instruction: Instruction, values: Mapping[str, FieldValue]) -> Instruction | None:
    """The instruction a template's instruction must become: its fields' values in its
    arguments (Words joined as parse joins continued lines); a field alone, its Step."""
    alone = _FIELD.fullmatch(template_instruction.keyword)
    if alone and not template_instruction.args:
        step = values[alone.group(1)]
        if not isinstance(step, Step):
            raise ConfigError(f"Dockerfile template field {alone.group(1)} stands alone on its line: it needs a Step")
        return None if step.keyword is None else Instruction(step.keyword.upper(), _text(step.args, " "))
    args = _FIELD.sub(lambda m: _text(values[m.group(1)], " "), template_instruction.args)
    return Instruction(template_instruction.keyword, args)


def parse(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile as Docker's parser reads them: comment lines and blank
    lines dropped (inside a continuation too), a line ending in a backslash continued on the
    next, the keyword case-insensitive. A heredoc is kept as the marker ``<<`` in the
    keyword, which no template holds, so a value that opens one is refused."""
    instructions: list[Instruction] = []
    pieces: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        continued = stripped.endswith("\\")
        pieces.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            instructions.append(_instruction(" ".join(p for p in pieces if p)))
            pieces = []
    if pieces:
        instructions.append(_instruction(" ".join(p for p in pieces if p)))
    return instructions


def _instruction(logical_line: str) -> Instruction:
    keyword, _, args = logical_line.partition(" ")
    keyword = keyword.upper()
    if keyword in ("RUN", "COPY", "ADD") and _HEREDOC.search(args):
        keyword += " <<"
    return Instruction(keyword, args.strip())


def write_context(files: ContextFiles, dest: Path, epoch: int, force: bool = False) -> Path:
    """Write a context atomically, every mtime set to ``epoch`` (COPY keeps mtimes); a
    folder this tool did not write is refused unless ``force``."""
    with replace_dir(dest, force, "build context folder") as staging:
        for rel, (data, mode) in files.items():
            if data is None:
                raise VerifyError(f"{rel} has no content yet: the builder has not made it")
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
        for path in sorted(staging.rglob("*"), reverse=True):
            if path.is_dir():
                path.chmod(0o755)
            os.utime(path, (epoch, epoch))
        os.utime(staging, (epoch, epoch))
    return dest


def context_digest(files: ContextFiles) -> str:
    h = hashlib.sha256()
    for rel, (data, mode) in sorted(files.items()):
        h.update(f"{rel}\0{mode:o}\0".encode() + (data or b"") + b"\0")
    return h.hexdigest()
