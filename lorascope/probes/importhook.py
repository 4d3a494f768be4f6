"""Import hooks: run a callback right after a module finishes executing, or just before
it starts being looked for.

The probes must patch ``torch.distributed`` before DeepSpeed captures references to its
functions, without importing torch themselves (``import torch`` costs seconds and would
tax every Python process the launcher starts). A meta-path finder wraps the loader of the
watched modules; the module's own spec and loader are restored once it has run.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]

_hooks: dict[str, list[Hook]] = {}
_before: dict[str, list[Callable[[], None]]] = {}
_busy = threading.local()


def _fire(name: str, module: ModuleType) -> None:
    for hook in _hooks.pop(name, []):
        hook(module)  # hooks guard themselves: they never raise


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _fire(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        for early in _before.pop(name, []):
            early()  # may add hooks for this very module (see before_import)
        if name not in _hooks or getattr(_busy, "name", None) == name:
            return None
        _busy.name = name
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            _busy.name = None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, name)
        return spec


_finder = _Finder()


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    _hooks.setdefault(name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def before_import(name: str, hook: Callable[[], None]) -> None:
    """Call ``hook()`` when ``name`` is first looked for, before it runs (now, if it is
    already imported). The hook may register ``when_imported`` hooks for ``name``
    itself; it must not raise."""
    if name in sys.modules:
        hook()
        return
    _before.setdefault(name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
