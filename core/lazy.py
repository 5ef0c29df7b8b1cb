"""Lazy re-exports (PEP 562): a package names what it offers without importing it until first use, so
importing one leaf module of eagle3 never pulls in the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving each ``name`` of ``exports`` (name -> defining module)."""

    def module_getattr(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return module_getattr
