"""Secrets: which names a tool may ask for, where a value comes from, and reading it.

A tool's manifest lists the secrets it needs; the policy grants them per tool
(``tools.NAME.secrets``) and says where each value comes from on this host
(``secrets.NAME: {env: VAR}`` or ``{file: PATH}``). Values are read at call time, for the
granted secrets only, and never leave this module except as the tool's environment
(``LaunchSpec.secrets``) and as the strings the call's scrubber cuts out of everything else.

A source that gives no value makes the call fail with ``secret_unavailable``. What the
caller is told names the secret and the kind of source (the variable's name for ``env``);
a file's path is a host path, which answers never carry: it goes to the operator
log only.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runner.schema.redaction import Scrubber

SECRET_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
# What the runner and its sandboxes set themselves: a secret of that name would override it.
RESERVED_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "HOME",
        "TMPDIR",
        "TOOL_NAME",
        "REQUEST_ID",
        "WORKSPACE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    }
)
# RUNNER_* steers the launcher (which runs as root); LD_* would steer it before the tool.
RESERVED_PREFIXES = ("RUNNER_", "LD_")
# A PEM private key fits easily; a secret is not a data file, and every answer of the
# call is searched for it.
MAX_SECRET_BYTES = 16 * 1024
MAX_LINKS = 40  # as the kernel's own bound on links in one path


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a secret's name, or None when it can."""
    if not SECRET_NAME.fullmatch(name):
        return f"{name!r} is not a secret name ([A-Z_][A-Z0-9_]*)"
    if name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES):
        return f"{name} is set by the runner and cannot be a secret"
    return None


class SecretSource(BaseModel):
    """``secrets.NAME`` in the policy: exactly one of ``env`` or ``file``.

    ``optional: true`` is the operator saying that the tool works without it (say, from
    bundled data): no value here then means the variable is simply not set for the tool,
    rather than ``secret_unavailable``. It never grants anything: the grant stays
    ``tools.NAME.secrets``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    file: str | None = Field(default=None, min_length=1)
    optional: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: VARIABLE or file: PATH")
        return self


@dataclass(frozen=True)
class Unavailable:
    """A granted secret without a value here: ``told`` is for the caller (no host path,
    no value), ``for_operator`` adds the file's path."""

    name: str
    told: str
    for_operator: str


@dataclass(frozen=True)
class SecretValues:
    """The values of one call's granted secrets, and those that could not be read."""

    values: Mapping[str, str] = field(default_factory=dict, repr=False)
    missing: tuple[Unavailable, ...] = ()

    @property
    def scrubber(self) -> Scrubber:
        """Every value, and the forms JSON gives it inside a string, to be cut out of
        whatever leaves the sandbox."""
        return Scrubber(frozenset(form for value in self.values.values() for form in _forms(value)))


NO_SECRET_VALUES = SecretValues()


def _forms(value: str) -> set[str]:
    # A tool that prints JSON escapes quotes, backslashes, control and (ensure_ascii)
    # non-ASCII characters; the parsed strings hold the verbatim value again.
    return {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}


class _NoValue(Exception):
    """A source that gives no usable value; the message is safe for the caller."""


class _Absent(_NoValue):
    """A source that is not there at all (variable unset, no such file): what ``optional``
    forgives. A source that is there but refused (world-writable, too large) never is."""


def read_secrets(names: Iterable[str], sources: Mapping[str, SecretSource], base_dir: Path) -> SecretValues:
    """Read each of ``names`` from its source (a file path relative to ``base_dir``).

    A name without a source is reported as missing (the policy's own validation makes
    every granted name have one). Never raises for a source that cannot be read.
    """
    values: dict[str, str] = {}
    missing: list[Unavailable] = []
    for name in names:
        source = sources.get(name)
        if source is None:
            missing.append(Unavailable(name, "no source is configured", "no source is configured"))
            continue
        if source.env is not None:
            where = f"environment variable {source.env}"
            told, operator_where = where, where
        else:
            path = base_dir / str(source.file)
            told, operator_where = "its file", f"file {path}"
        try:
            values[name] = _read_env(str(source.env)) if source.env is not None else _read_file(path)
        except _Absent as exc:
            if not source.optional:
                missing.append(Unavailable(name, f"{told} {exc}", f"{operator_where} {exc}"))
        except _NoValue as exc:
            missing.append(Unavailable(name, f"{told} {exc}", f"{operator_where} {exc}"))
    return SecretValues(values, tuple(missing))


def _read_env(variable: str) -> str:
    value = os.environ.get(variable)
    if value is None:
        raise _Absent("is not set")
    return _checked(value)


def _read_file(path: Path) -> str:
    """The file's text, one trailing newline dropped (``echo key > file`` writes one).

    Symlinks are followed (Kubernetes and Docker mount secrets through them), but only
    those of root or the runner's user (``_foreign_link``): another user's link would have
    the runner, often root, read a file that user may not. What is refused besides: anything
    but a regular file (``O_NONBLOCK`` so a FIFO planted there cannot hang the call), a file
    any user may write (its value is not a secret), more than ``MAX_SECRET_BYTES``.
    """
    foreign, reached = _foreign_link(path)
    if foreign is not None:  # the link's path is not the caller's to know
        raise _NoValue("is reached through a symbolic link of another user's")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise _Absent(f"cannot be opened ({exc.strerror})") from None
    except OSError as exc:
        raise _NoValue(f"cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if reached is not None and (info.st_dev, info.st_ino) != reached:
            # A link swapped after the walk: the file opened is not the one approved.
            raise _NoValue("is reached through a symbolic link of another user's")
        if not stat.S_ISREG(info.st_mode):
            raise _NoValue("is not a regular file")
        if info.st_mode & stat.S_IWOTH:
            raise _NoValue("is writable by any user")
        chunks, size = [], 0
        while size <= MAX_SECRET_BYTES and (chunk := os.read(fd, MAX_SECRET_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _NoValue(f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if size > MAX_SECRET_BYTES:
        raise _NoValue(f"is larger than {MAX_SECRET_BYTES} bytes")
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise _NoValue("is not UTF-8 text") from None
    return _checked(text.removesuffix("\n").removesuffix("\r"))


def _foreign_link(path: Path) -> tuple[str | None, tuple[int, int] | None]:
    """The first symbolic link on the way to ``path`` (in a link's target too) that is
    neither root's nor the runner user's, or None; and the (device, inode) the way ends at,
    for the file opened to be checked against (None: the way ends before a file)."""
    me, left = os.getuid(), MAX_LINKS
    here = Path("/") if path.is_absolute() else Path.cwd()
    parts = list(path.parts[1:] if path.is_absolute() else path.parts)
    info = None
    while parts:
        part = parts.pop(0)
        if part == "..":
            here, info = here.parent, None
            continue
        step = here / part
        try:
            info = os.lstat(step)
        except OSError:
            return None, None
        if not stat.S_ISLNK(info.st_mode):
            here = step
            continue
        if info.st_uid not in (0, me) or (left := left - 1) < 0:
            return str(step), None
        target = step.readlink()
        parts = [*(target.parts[1:] if target.is_absolute() else target.parts), *parts]
        if target.is_absolute():
            here = Path("/")
    return None, (info.st_dev, info.st_ino) if info is not None else None


def _checked(value: str) -> str:
    if not value:
        raise _NoValue("is empty")
    if "\0" in value:
        raise _NoValue("holds a NUL character")
    try:
        value.encode("utf-8")  # os.environ keeps undecodable bytes as surrogates
    except UnicodeEncodeError:
        raise _NoValue("is not UTF-8 text") from None
    if len(value.encode("utf-8")) > MAX_SECRET_BYTES:
        raise _NoValue(f"is larger than {MAX_SECRET_BYTES} bytes")
    return value
