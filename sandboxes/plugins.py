"""Backends are found by name through the entry-point group ``runner.sandboxes``.

A distribution registers a backend in its ``pyproject.toml``::

    [project.entry-points."runner.sandboxes"]
    nsjail = "my_package.backend:create"

``create`` is called with the policy's ``sandbox.backends.nsjail`` mapping (or ``{}``) and
returns a backend (``sandboxes.base.Sandbox``); it must do no I/O, and it raises
``BackendConfigError`` for a mapping it cannot use. ``subprocess`` and ``docker`` are
registered by this distribution the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from sandboxes.base import BackendConfigError, Sandbox, StartsEarly

GROUP = "runner.sandboxes"


class UnknownBackend(LookupError):
    """No installed distribution registers a backend of that name."""


@functools.cache
def installed() -> dict[str, EntryPoint]:
    """Every registered backend by name (read once per process)."""
    return {point.name: point for point in entry_points(group=GROUP)}


def create(name: str, config: Mapping[str, Any] | None = None) -> Sandbox:
    """A new backend ``name`` configured with ``config``.

    Raises:
        UnknownBackend: nothing registers ``name``.
        BackendConfigError: the backend refuses ``config``, or its plugin cannot be loaded.
    """
    point = installed().get(name)
    if point is None:
        raise UnknownBackend(name)
    try:
        factory = point.load()
    except Exception as exc:  # a third party's import error is a configuration problem here
        problem = f"{type(exc).__name__}: {exc}"
        raise BackendConfigError(f"the {name!r} backend cannot be loaded: {problem}") from exc
    backend: Sandbox = factory(dict(config or {}))
    return backend


def start_early(name: str) -> None:
    """Begin what backend ``name`` starts before its first sandbox (``StartsEarly``: our
    backends' watchdog), when it has such a part. Never raises: a backend that cannot be
    made, or started, says so when a call uses it."""
    try:
        backend = create(name)
    except (UnknownBackend, BackendConfigError):
        return
    if isinstance(backend, StartsEarly):
        backend.start_early()
