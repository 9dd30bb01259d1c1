"""The key of a keyed audit chain: ``audit: {chain: true, key: {env: NAME} | {file: PATH}}``.

With a key each line's ``hash`` is HMAC-SHA256 under it instead of SHA-256, so whoever can
write the log but cannot read the key cannot make a rewritten line verify. The runner that
writes and ``runner audit verify`` read the key here, the same way. A key that cannot be
read is an error (``ChainKeyError``), never a chain written or checked without it. The
key's bytes go to ``hmac`` only: no message, event, answer or ``repr`` holds them.

A key file is opened without following a symbolic link anywhere on its path (the runner is
often root: a link another user planted must not choose the key), must be a regular file of
the runner's user (or root's), and must be closed to group and others.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runner.errors import ConfigError

# A shorter key could be found by trying keys offline against any one line and its hash.
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096  # a key, not a data file


class ChainKeySource(BaseModel):
    """``audit.key`` in the policy: exactly one of ``env`` or ``file`` (relative to the
    policy file's folder)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> ChainKeySource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: VARIABLE or file: PATH")
        return self


class ChainKeyError(Exception):
    """The key cannot be used. The message names the source and says why; never the key."""


@dataclass(frozen=True)
class ChainKey:
    """A key read from its source; ``where`` names the source for messages."""

    secret: bytes = field(repr=False)
    where: str


def read_chain_key(source: ChainKeySource, base_dir: Path, env: Mapping[str, str] | None = None) -> ChainKey:
    """The key ``source`` gives (a file path relative to ``base_dir``).

    Raises:
        ChainKeyError: the variable is unset or empty, the file cannot be opened safely or
            is open to others, or the key is shorter than ``MIN_KEY_BYTES`` or longer than
            ``MAX_KEY_BYTES``.
    """
    if source.env is not None:
        where = f"environment variable {source.env}"
        value = (os.environ if env is None else env).get(source.env)
        if value is None:
            raise ChainKeyError(f"{where} is not set")
        secret = os.fsencode(value)
    else:
        path = Path(os.path.abspath(base_dir / str(source.file)))  # noqa: PTH100 (no symlink resolved)
        where = f"file {path}"
        secret = _read_key_file(path, where)
    if not secret:
        raise ChainKeyError(f"{where} is empty")
    if len(secret) < MIN_KEY_BYTES:
        raise ChainKeyError(
            f"{where} holds {len(secret)} bytes: a chain key needs at least {MIN_KEY_BYTES} "
            "(for example: head -c 32 /dev/urandom | base64)"
        )
    if len(secret) > MAX_KEY_BYTES:
        raise ChainKeyError(f"{where} holds more than {MAX_KEY_BYTES} bytes")
    return ChainKey(secret, where)


def policy_chain_key(source: ChainKeySource | None, base_dir: Path, policy_file: str) -> ChainKey | None:
    """The key of a policy's audit chain (its ``audit.key``, relative to ``base_dir``); None
    when it sets none.

    Raises:
        ConfigError: it sets one that cannot be read (``read_chain_key``).
    """
    if source is None:
        return None
    try:
        return read_chain_key(source, base_dir)
    except ChainKeyError as exc:
        raise ConfigError(
            policy_file, f"audit.key: {exc}: a keyed chain is never used without its key"
        ) from None


def _read_key_file(path: Path, where: str) -> bytes:
    """The file's bytes, one trailing newline dropped (``echo KEY > file`` writes one)."""
    try:
        fd = _open_without_links(path)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ChainKeyError(
                f"{where}: its path holds a symbolic link, never followed to a key: give the real path"
            ) from None
        raise ChainKeyError(f"{where} cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ChainKeyError(f"{where} is not a regular file")
        if info.st_uid not in (os.geteuid(), 0):
            raise ChainKeyError(f"{where} belongs to uid {info.st_uid}, neither the runner's user nor root")
        if info.st_mode & 0o077:
            raise ChainKeyError(
                f"{where} is open to group or others (mode {stat.S_IMODE(info.st_mode):04o}): chmod 600 it"
            )
        data = os.read(fd, MAX_KEY_BYTES + 3)
    except OSError as exc:
        raise ChainKeyError(f"{where} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    return data.removesuffix(b"\n").removesuffix(b"\r")


def _open_without_links(path: Path) -> int:
    """``path`` (absolute, normalized) opened for reading one folder at a time, each step
    relative to the last with ``O_NOFOLLOW``: a symbolic link anywhere is ``ELOOP`` (or
    ``ENOTDIR``). ``O_NONBLOCK``: a FIFO planted there cannot hang the load.

    Raises:
        OSError: a step cannot be opened.
    """
    if len(path.parts) < 2:
        raise OSError(errno.EISDIR, "Is a directory")
    # O_PATH: a folder the runner may search but not list (mode 0711) still leads on.
    folder = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        *folders, name = path.parts[1:]
        for part in folders:
            step = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            os.close(folder)
            folder = step
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        return os.open(name, flags, dir_fd=folder)
    finally:
        os.close(folder)
