"""The one way jopd declares configs: frozen, hashable, validated dataclasses (pydantic).

Unknown keys and wrong types fail at construction with an error naming the field, e.g.
`SamplingConfig.top_p: Input should be less than or equal to 1`. Every component declares its own
config next to its code with `@config_dataclass`; `jopd.run.config` composes them into a run config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, TypeVar

import pydantic
import yaml

T = TypeVar("T")

_PYDANTIC_CONFIG = pydantic.ConfigDict(extra="forbid", validate_default=True)


def config_dataclass(cls: type[T]) -> type[T]:
    """Decorator: a frozen pydantic dataclass that rejects unknown keys (usable as a jit static arg)."""
    return pydantic.dataclasses.dataclass(frozen=True, config=_PYDANTIC_CONFIG)(cls)


class ConfigError(ValueError):
    """Bad config input; the message is one line naming the offending field."""


def build(cls: type[T], data: dict[str, Any] | None, where: str = "") -> T:
    """Construct `cls` from a dict, turning pydantic's error into one line `where.field: message`."""
    prefix = where or cls.__name__
    try:
        return cls(**(data or {}))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        field = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"]
        if err["type"] == "unexpected_keyword_argument":
            msg = "unknown key"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            inner = err["ctx"]["error"]
            if isinstance(inner, ConfigError):  # a nested config's error, its path relative to this field
                raise ConfigError(f"{field}.{inner}") from None
            msg = str(inner)  # our validators' own one-line message, without pydantic's prefix
        raise ConfigError(f"{field}: {msg}") from None
    except TypeError as e:  # non-dict nesting etc.
        raise ConfigError(f"{prefix}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def read_yaml_mapping(path: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (a config file); a missing file, bad YAML or another top level
    is one line naming the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: config file not found")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data
