"""lowsync: LLM compute graphs on CPU, CUDA and Vulkan with the host out of the device's way.

Build a graph, compile it for a context (backends + sync policy), then per step write inputs,
compute and read outputs::

    import numpy as np
    import lowsync as ls

    g = ls.Graph()
    x = g.input("x", [2, 4])
    w = g.weight("w", np.ones((4, 3), np.float32))
    g.output("y", x @ w)
    plan = ls.Context(["cpu"]).compile(g)
    plan.set_input("x", np.ones((2, 4), np.float32))
    plan.compute()
    y = plan.get_output("y")

Importing this package loads only the native module; model loading (`lowsync.gguf`) and model
graphs (`lowsync.models`) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lowsync._native import (
    BackendError,
    BackendUnavailableError,
    Context,
    EnvError,
    Graph,
    GraphError,
    InputError,
    LowsyncError,
    Plan,
    ReallocError,
    Tensor,
    UnknownBackendError,
    UnsupportedError,
    available_backends,
    stat_names,
    version,
)

__version__: str = version()

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "Context",
    "EnvError",
    "Graph",
    "GraphError",
    "InputError",
    "LowsyncError",
    "Plan",
    "ReallocError",
    "Tensor",
    "UnknownBackendError",
    "UnsupportedError",
    "__version__",
    "available_backends",
    "stat_names",
    "version",
]

# Names served lazily from heavier submodules (they import `gguf` and friends), so that
# `import lowsync` stays fast. A name appears here only once its module exists in the package.
_LAZY: dict[str, str] = {
    "load_gguf": "lowsync.gguf",
    "Llama": "lowsync.models",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'lowsync' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but one of its own imports (e.g. `gguf`) is missing
        raise AttributeError(
            f"lowsync.{name} is not available in lowsync {__version__}: "
            f"{module_name} has not been written yet"
        ) from None
    value = getattr(module, name)
    globals()[name] = value
    return value
