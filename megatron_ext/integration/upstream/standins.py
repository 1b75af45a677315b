"""Stand-in modules for imports that upstream GPT training never uses but imports at start-up.

Megatron-DeepSpeed's ``megatron/training.py`` imports its vision code (which imports ``torchvision``;
the wheel on the package index does not load beside the CPU build of torch) and
``deepspeed.compression.compress`` (gone from DeepSpeed 0.19; used only with
``--compression-training``). :func:`install` adds a stand-in for such a module only when it is not
installed: every attribute of a stand-in is a class that can be named and subclassed at import
time, but calling or instantiating it raises :class:`StandInError` naming the missing package.
:func:`uninstall` removes the finder and the stand-in modules again.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

STANDINS = {
    "torchvision": "imported by Megatron-DeepSpeed's vision code, which GPT training does not run",
    "deepspeed.compression.compress": "imported by Megatron-DeepSpeed for --compression-training, "
    "which DeepSpeed 0.19 no longer provides",
}


class StandInError(RuntimeError):
    """Code reached a stand-in: the real package is needed after all."""


def _unavailable(module: str, name: str, why: str) -> type:
    message = (
        f"{module}.{name} was called, but {module} is a stand-in (not installed; {why}): install the "
        f"real package, or avoid the option that needs it"
    )

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise StandInError(message)

    # __new__ covers instances of subclasses too (class ImageFolder(VisionDataset) is defined at import).
    return type(name, (), {"__new__": fail, "__module__": module, "__doc__": message})


class StandInModule(types.ModuleType):
    """A module whose attributes are :func:`_unavailable` classes; submodules are stand-ins too."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(name, f"stand-in: {why}")
        self.__stand_in__ = why

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # keep introspection (pickle, inspect, hasattr(__file__)) honest
            raise AttributeError(attr)
        value = _unavailable(self.__name__, attr, self.__stand_in__)
        setattr(self, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: dict[str, str]) -> None:
        self.roots = roots

    def _why(self, fullname: str) -> str | None:
        for root, why in self.roots.items():
            if fullname == root or fullname.startswith(root + "."):
                return why
        return None

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self._why(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name, self._why(spec.name) or "")
        module.__path__ = []  # a package, so that `import torchvision.transforms` works
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # nothing to run: the module's attributes are made on demand


_finder: _Finder | None = None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def install(names: dict[str, str] | None = None) -> list[str]:
    """Add stand-ins for the modules of ``names`` (default :data:`STANDINS`) that are not installed;
    returns the names that got one."""
    global _finder
    missing = {name: why for name, why in (names or STANDINS).items() if not _installed(name)}
    if missing:
        uninstall()
        _finder = _Finder(missing)
        sys.meta_path.append(_finder)  # last: a real module found on the way always wins
    return sorted(missing)


def uninstall() -> None:
    """Remove the finder and the stand-in modules imported through it."""
    global _finder
    if _finder is None:
        return
    sys.meta_path.remove(_finder)
    for name in [n for n, m in sys.modules.items() if isinstance(m, StandInModule)]:
        del sys.modules[name]
    _finder = None
