"""Run a function right after a module is imported, without importing it ourselves.

A meta-path finder that answers for the watched names only: it lets the normal machinery find
the module, then wraps that spec's loader so `callback(module)` runs once the module body has
executed. A module already imported gets its callbacks at once. A spec that is only looked
up (`importlib.util.find_spec`), never executed, triggers nothing.
"""

import importlib.util
import sys

from . import warn

_pending = {}  # module name -> [callback, ...]


def after_import(name, callback):
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, [callback])
        return
    _pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _run(name, module, callbacks):
    for cb in callbacks:
        try:
            cb(module)
        except Exception as exc:  # noqa: BLE001 - a hook runs inside the user's training: never break it over the hook
            warn(f"hook after `import {name}` failed: {exc!r}")


class _Finder:
    def __init__(self):
        self.busy = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _pending or name in self.busy:
            return None
        self.busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy.discard(name)
        loader = getattr(spec, "loader", None)
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec  # a shared (class) loader: leave it alone
        # Callbacks are taken when the module body runs, not here: `importlib.util.find_spec`
        # (how libraries ask "is torch installed?") reaches this finder without importing.
        original = loader.exec_module

        def exec_module(module):
            try:
                original(module)
            finally:
                try:
                    del loader.exec_module  # back to the class's method
                except AttributeError:
                    pass
            callbacks = _pending.pop(name, None)
            if not _pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            if callbacks:
                _run(name, module, callbacks)

        loader.exec_module = exec_module
        return spec


_FINDER = _Finder()
