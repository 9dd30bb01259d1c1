"""Reading a backend's settings (the policy's ``sandbox.backends.NAME``) into its model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from sandboxes.base import BackendConfigError

ConfigModel = TypeVar("ConfigModel", bound=BaseModel)


def read_config(model: type[ConfigModel], backend: str, config: Mapping[str, Any]) -> ConfigModel:
    """``config`` validated as ``model``.

    Raises:
        BackendConfigError: an unknown key or a wrong type, named with its place.
    """
    try:
        return model.model_validate(dict(config))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "(root)"
        raise BackendConfigError(f"sandbox.backends.{backend}: {where}: {error['msg']}") from exc
