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

Run a model: ``sess = ls.Session(ls.Llama.random("tiny", seed=0), backends=["cpu-async"])``,
then ``sess.generate([1, 2, 3], max_new_tokens=16)`` (see `lowsync.session`).

Importing this package loads only the native module; model loading (`lowsync.gguf`), model
graphs (`lowsync.models`) and the session (`lowsync.session`) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lowsync._native import (
    BackendError,
    BackendUnavailableError,
    Context,
    EnvError,
    Graph,
    GraphError,
    InputError,
    LowsyncError,
    PendingOutput,
    Plan,
    ReallocError,
    Tensor,
    UnknownBackendError,
    UnsupportedError,
    available_backends,
    dequantize,
    enable_tracing,
    stat_names,
    version,
)

if TYPE_CHECKING:  # served lazily at run time (see `_LAZY`); visible to type checkers here
    from lowsync.gguf import GGUFError as GGUFError
    from lowsync.gguf import load_gguf as load_gguf
    from lowsync.gguf import save_gguf as save_gguf
    from lowsync.llm import LLM as LLM
    from lowsync.models import Llama as Llama
    from lowsync.models import LlamaConfig as LlamaConfig
    from lowsync.models import ModelError as ModelError
    from lowsync.sampling import SamplerParams as SamplerParams
    from lowsync.session import ContextFullError as ContextFullError
    from lowsync.session import Session as Session
    from lowsync.session import SessionError as SessionError
    from lowsync.tokenizer import Tokenizer as Tokenizer

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
    "PendingOutput",
    "Plan",
    "ReallocError",
    "Tensor",
    "UnknownBackendError",
    "UnsupportedError",
    "__version__",
    "available_backends",
    "dequantize",
    "enable_tracing",
    "stat_names",
    "version",
]

# Names served lazily from heavier submodules (they import `gguf` and friends), so that
# `import lowsync` stays fast. A name appears here only once its module exists in the package.
_LAZY: dict[str, str] = {
    "load_gguf": "lowsync.gguf",
    "save_gguf": "lowsync.gguf",
    "GGUFError": "lowsync.gguf",
    "LLM": "lowsync.llm",
    "Llama": "lowsync.models",
    "LlamaConfig": "lowsync.models",
    "ModelError": "lowsync.models",
    "SamplerParams": "lowsync.sampling",
    "Session": "lowsync.session",
    "SessionError": "lowsync.session",
    "ContextFullError": "lowsync.session",
    "Tokenizer": "lowsync.tokenizer",
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
