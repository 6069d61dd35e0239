"""Optional database drivers, imported when a backend is first constructed."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or explain which extra installs it.

    Raises:
        ImportError: The driver is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {extra} lease backend needs {module!r}; install it with: "
            f"pip install 'rxcoord[{extra}]'"
        ) from exc
