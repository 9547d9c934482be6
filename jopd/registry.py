"""Named registries: the one way a researcher adds a loss kind, a task or a model family.

    LOSSES = Registry("loss kind")                 # in the package that owns the seam
    @LOSSES.register("alpha_div")                  # in any module, the user's own included
    def ...

An entry is looked up by name (`REG["alpha_div"]`; an unknown name is one line listing the registered ones), and
config fields that name an entry validate against the registry at load time (`registered(REG)`), so a user's
entry is accepted exactly like a built-in one. A run config's `plugins: [my_module, ./my_file.py]` imports
the user's modules before the config is validated (`load_plugins`), which is what registers their entries.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Generic, TypeVar

import pydantic

E = TypeVar("E")


class Registry(Generic[E]):
    """name -> entry, in registration order. Registering a taken name is an error (no silent override)."""

    def __init__(self, what: str):
        self.what = what  # e.g. "loss kind": how errors name an entry
        self._entries: dict[str, E] = {}

    def add(self, name: str, entry: E) -> E:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what}: a name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[E], E]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> None:
        """Drop an entry (tests that register a temporary one clean up with this)."""
        self._entries.pop(name, None)

    def __getitem__(self, name: str) -> E:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: object) -> str:
        return f"unknown {self.what} {name!r} (registered: {', '.join(self._entries)})"

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self):
        return self._entries.items()


def registered(registry: Registry) -> type[str]:
    """A pydantic field type: a string that names an entry of `registry` (checked when the config is built, so
    entries registered by plugins count)."""

    def check(name: str) -> str:
        if name not in registry:
            raise ValueError(registry.unknown(name))
        return name

    return Annotated[str, pydantic.AfterValidator(check)]


def resolve_plugins(plugins, base: str | Path | None = None, *, only_existing: bool = False) -> tuple[str, ...]:
    """The plugins with each relative `.py` path made absolute against `base`, so a run's saved config imports
    the same files from wherever it is read back. `only_existing`: resolve only the paths that exist under
    `base` (the rest are left for a later base, e.g. the working directory after the config's folder)."""
    if not isinstance(plugins, (list, tuple)):
        raise ValueError(f"plugins: expected a list of module names or .py paths, got {plugins!r}")
    out = []
    for plugin in plugins:
        if isinstance(plugin, str) and plugin.endswith(".py") and not Path(plugin).is_absolute() and base is not None:
            candidate = (Path(base) / plugin).resolve()
            if candidate.is_file() or not only_existing:
                plugin = str(candidate)
        out.append(plugin)
    return tuple(out)


def load_plugins(plugins: list[str] | tuple[str, ...], base: str | Path | None = None) -> None:
    """Import each plugin: a module name (`my_pkg.my_loss`) or a `.py` file (relative to `base`, the config's
    folder). Importing twice is a no-op. A plugin that cannot be found or raises is one line naming it."""
    for plugin in plugins:
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugins: expected a module name or a .py path, got {plugin!r}")
        if plugin.endswith(".py"):
            path = Path(plugin)
            if not path.is_absolute() and base is not None:
                path = Path(base) / path
            path = path.resolve()
            name = "jopd_plugin_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            if name in sys.modules:
                continue
            if not path.is_file():
                raise FileNotFoundError(f"plugins: {path}: file not found")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[name]
                raise ValueError(f"plugins: {plugin}: import failed ({type(e).__name__}: {e})") from None
        else:
            try:
                importlib.import_module(plugin)
            except ModuleNotFoundError as e:
                if e.name and plugin.startswith(e.name):
                    raise ValueError(f"plugins: {plugin}: no such module") from None
                raise ValueError(f"plugins: {plugin}: import failed ({type(e).__name__}: {e})") from None
            except Exception as e:
                raise ValueError(f"plugins: {plugin}: import failed ({type(e).__name__}: {e})") from None
