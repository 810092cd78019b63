"""Run code when another library's module is imported, without importing that library.

:func:`when_imported` calls ``callback(module)`` once the module has been executed: at once if it already is,
else from an import hook (a meta-path finder that wraps the module's loader), before any later ``from module
import name`` reads it. The integrations use it to meet TRL's trainers wherever a user imports them, while
``import nmst_fast`` itself imports neither TRL nor transformers.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

_CALLBACKS: dict[str, list[Callable]] = {}
_LOCK = threading.Lock()


def when_imported(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` for the module ``name`` now if it is imported, else once it is (idempotent for
    the same callback)."""
    with _LOCK:
        callbacks = _CALLBACKS.setdefault(name, [])
        if callback in callbacks:
            return
        callbacks.append(callback)
        if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    module = sys.modules.get(name)
    if module is not None:
        callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a watched module as the other finders on ``sys.meta_path`` do (an editable install's own finder
    among them), and runs its callbacks once it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in _CALLBACKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for callback in list(_CALLBACKS.get(self._name, ())):
            callback(module)
