"""Type stub of the extension module `lowsync._native` (crates/bindings).

Hand-written and checked against the built module with `python -m mypy.stubtest lowsync._native`.
Shapes are numpy order (row-major, last axis fastest). Dtype names: "f32", "f16", "bf16", "i32",
and the GGUF block types of weights: "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k",
"q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs".
"""

from collections.abc import Sequence
from typing import Any, final

import numpy.typing as npt

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
    "available_backends",
    "cuda_fusion_plan",
    "dequantize",
    "device_type",
    "enable_tracing",
    "env_flag",
    "stat_names",
    "version",
]

# ---- errors -------------------------------------------------------------------------------------

class LowsyncError(Exception):
    """Base class of every error lowsync raises."""

class GraphError(LowsyncError, ValueError):
    """A node could not be built: wrong shapes or dtypes (the message names the op and shapes)."""

class InputError(LowsyncError, ValueError):
    """Wrong input or output name, shape or dtype at `Plan.set_input` / `Plan.get_output`."""

class UnknownBackendError(LowsyncError, ValueError):
    """A backend name that lowsync does not know."""

class EnvError(LowsyncError, ValueError):
    """A bad value in a `LOWSYNC_*` environment variable (the message names the variable)."""

class BackendError(LowsyncError, RuntimeError):
    """A backend failed while running: a kernel error (an index out of range), a buffer error."""

class UnsupportedError(BackendError):
    """The backend, or this version of lowsync, does not support what was asked."""

class BackendUnavailableError(BackendError):
    """The backend is known but cannot run here (no device, no driver)."""

class ReallocError(LowsyncError, RuntimeError):
    """A reallocation that `LOWSYNC_SCHED_DEBUG_REALLOC` turns into an error."""

# ---- functions ----------------------------------------------------------------------------------

def available_backends() -> list[str]:
    """Backends usable on this machine, e.g. `["cpu", "cpu-async", "noop"]`."""

def cuda_fusion_plan(plan: Plan, split: int = 0) -> list[str]:
    """What the CUDA backend launches for split `split` of `plan` (fusion on), worked out
    without a device (the plan may be compiled for any backend): one line per launch,
    `fused <kind> [<member ops>]` or a node's op. A split that does not exist is an
    `InputError`."""

def dequantize(
    data: npt.NDArray[Any] | bytes | bytearray | memoryview,
    dtype: str,
    shape: Sequence[int] | None = None,
) -> npt.NDArray[Any]:
    """The float32 values of raw blocks of a block dtype (the CPU backend's reference,
    bit-exact with `gguf.quants.dequantize`). `shape` is the logical shape; it may be left out
    for a uint8 array of GGUF's byte shape `[..., row_bytes]`."""

def stat_names() -> list[str]:
    """The counter names of `Context.stats()`, in their fixed order."""

def device_type(name: str) -> str:
    """The kind of device backend `name` runs on: "cpu", "gpu", or a Vulkan device's type
    ("cpu" for a software rasteriser such as lavapipe, "discrete_gpu", ...)."""

def env_flag(var: str, default: bool) -> bool:
    """Reads the 0/1 flag `var` (one the Python package reads); a bad value is an `EnvError`."""

def enable_tracing(filter: str) -> None:
    """Sends lowsync's tracing spans (per step, split, submit) to stderr, filtered like RUST_LOG
    (e.g. ``"lowsync_scheduler=debug"``). Once per process."""

def version() -> str:
    """The version of the native module (equal to `lowsync.__version__`)."""

# ---- graph building -----------------------------------------------------------------------------

@final
class Tensor:
    """A node of a `Graph`; created only by `Graph` methods."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def id(self) -> int: ...
    @property
    def T(self) -> Tensor:
        """The last two axes swapped (a view)."""

    def __matmul__(self, other: Tensor, /) -> Tensor: ...
    def __rmatmul__(self, other: Tensor, /) -> Tensor: ...
    def __add__(self, other: Tensor, /) -> Tensor: ...
    def __radd__(self, other: Tensor, /) -> Tensor: ...
    def __mul__(self, other: Tensor | float, /) -> Tensor: ...
    def __rmul__(self, other: float, /) -> Tensor: ...

@final
class Graph:
    """A compute graph under construction."""

    def __new__(cls) -> Graph: ...
    @property
    def n_nodes(self) -> int: ...
    @property
    def n_leafs(self) -> int: ...
    def input(self, name: str, shape: Sequence[int], dtype: str = "f32") -> Tensor: ...
    def weight(
        self,
        name: str,
        data: npt.NDArray[Any] | bytes | bytearray | memoryview,
        backend: str | None = None,
        dtype: str | None = None,
        shape: Sequence[int] | None = None,
    ) -> Tensor:
        """A constant tensor, optionally pinned to a backend.

        Data that cannot change is borrowed, not copied: a C-contiguous array of the weight's
        dtype over a read-only memory map or `bytes` (what `load_gguf` gives), or `bytes`
        itself; the graph and the context keep it alive, and `cpu`/`cpu-async` read it in
        place. Anything else (a writeable array, or one whose owner could make it writeable
        again) is copied.

        For a block dtype (`dtype="q4_0"`, ...) `data` is the raw blocks (a uint8 array, bytes
        or a memoryview) and `shape` the logical shape in elements, which may be left out for a
        uint8 array of GGUF's byte shape `[..., row_bytes]`; the byte count must be exact."""
    def persistent(
        self, name: str, shape: Sequence[int], dtype: str = "f32", backend: str | None = None
    ) -> Tensor:
        """Zero-initialised state kept across steps, optionally pinned to a backend.

        Plans compiled by one Context share persistent tensors (and weights) by name.
        """
    def output(self, name: str, t: Tensor) -> None: ...
    def get_rows(self, table: Tensor, ids: Tensor) -> Tensor: ...
    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor: ...
    def add(self, a: Tensor, b: Tensor) -> Tensor: ...
    def mul(self, a: Tensor, b: Tensor) -> Tensor: ...
    def scale(self, a: Tensor, s: float) -> Tensor: ...
    def rms_norm(self, x: Tensor, eps: float = 1e-5) -> Tensor: ...
    def rope(
        self,
        x: Tensor,
        pos: Tensor,
        n_dims: int | None = None,
        theta_base: float = 10000.0,
        mode: str = "normal",
    ) -> Tensor: ...
    def soft_max(self, x: Tensor, mask: Tensor | None = None, scale: float = 1.0) -> Tensor: ...
    def silu(self, x: Tensor) -> Tensor: ...
    def gelu(self, x: Tensor) -> Tensor: ...
    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor: ...
    def cpy(self, x: Tensor, dtype: str) -> Tensor: ...
    def cont(self, x: Tensor) -> Tensor: ...
    def concat(self, a: Tensor, b: Tensor, axis: int) -> Tensor: ...
    def set_rows(self, dst: Tensor, src: Tensor, idx: Tensor) -> Tensor: ...
    def argmax(self, x: Tensor) -> Tensor: ...
    def penalize(self, logits: Tensor, hist: Tensor, params: Tensor) -> Tensor:
        """llama.cpp's repeat / frequency / presence penalties: `logits` f32 [R, V], `hist`
        i32 [R, N] (recent ids; outside [0, V) is an empty slot), `params` f32 [R, 3]
        (repeat, frequency, presence); f32 [R, V]."""
    def sample(self, logits: Tensor, params: Tensor, key: Tensor) -> Tensor:
        """One token per row drawn on the device: `logits` f32 [R, V], `params` f32 [R, 4]
        (temperature, top_k, top_p, min_p; temperature <= 0 is the argmax), `key` i32 [R, 2]
        (seed, counter: a Philox key, so one key gives one token on every backend); i32 [R]."""
    def mul_mat_id(self, experts: Tensor, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor: ...
    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor: ...
    def permute(self, x: Tensor, axes: Sequence[int]) -> Tensor: ...
    def transpose(self, x: Tensor, ax0: int = ..., ax1: int = ...) -> Tensor:
        """Swaps axes `ax0` and `ax1` (default -2 and -1, the last two); a view."""
    def slice(self, x: Tensor, axis: int, start: int, stop: int) -> Tensor: ...

# ---- running ------------------------------------------------------------------------------------

@final
class Plan:
    """A graph compiled for a context: write inputs, compute, read outputs."""

    @property
    def inputs(self) -> list[str]: ...
    @property
    def outputs(self) -> list[str]: ...
    @property
    def n_nodes(self) -> int: ...
    @property
    def n_leafs(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def policy(self) -> str: ...
    @property
    def n_splits(self) -> int:
        """Runs of consecutive nodes on one backend."""
    @property
    def split_backends(self) -> list[str]:
        """The backend of each split, in order."""
    def set_input(self, name: str, data: npt.NDArray[Any]) -> None:
        """Copies `data` (any memory layout, read in C order) into input `name`."""
    def compute(self) -> None: ...
    def get_output(self, name: str) -> npt.NDArray[Any]:
        """Waits for the step and returns output `name`; an `InputError` before any `compute`
        of this plan succeeded (the output holds no result yet)."""
    def feed(self, input: str, output: str) -> None:
        """Arms a device-side feed for the next `compute` only: `input` takes `output`'s bytes
        as the previous step left them, copied on the device in stream order.

        The launch-ahead decode loop (what `Session.generate` does)::

            plan.compute()                      # step 1, its token from the host
            pending = plan.read_async("next")
            while ...:
                plan.feed("tokens", "next")     # step k+1 takes token k on the device
                plan.compute()
                token = pending.wait()[0]       # token k: the one host wait
                pending = plan.read_async("next")
        """
    def can_feed(self, input: str, output: str) -> bool: ...
    def can_read_async(self, output: str) -> bool: ...
    def read_async(self, output: str) -> PendingOutput:
        """Queues a read of `output` after the steps queued so far; returns without waiting."""
    def compute_read_async(self, output: str) -> PendingOutput:
        """Queues one step (as `compute`) and a read of `output` behind it (as `read_async`
        right after it); returns without waiting. A backend that can (Vulkan) makes the step and
        its read one submission."""
    def synchronize(self) -> None: ...

@final
class PendingOutput:
    """An output read queued by `Plan.read_async` or `Plan.compute_read_async`."""

    @property
    def done(self) -> bool:
        """Whether the read completed (never waits)."""
    def wait(self) -> npt.NDArray[Any]:
        """Waits for the read (one host wait; none once waited) and returns the output."""

@final
class Context:
    """Backends and a sync policy ("stock", "relaxed" or "staged") that plans run on."""

    def __new__(
        cls,
        backends: str | Sequence[str] | None = None,
        policy: str | None = None,
        n_copies: int | None = None,
    ) -> Context:
        """Backends in priority order (user inputs start on `cpu`; default `["cpu"]`; one name
        is a list of one); `n_copies` (1 to 16, default 1) > 1 keeps that many copies of every
        split input so successive evaluations can overlap."""
    @property
    def backends(self) -> list[str]: ...
    @property
    def policy(self) -> str: ...
    @property
    def n_copies(self) -> int: ...
    def compile(self, graph: Graph) -> Plan:
        """Places, splits and allocates `graph` once. The first graph compiled (or reserved)
        is the worst case; a later graph that does not fit re-reserves (counted in
        `reallocs`; an error under LOWSYNC_SCHED_DEBUG_REALLOC)."""
    def reserve(self, graph: Graph) -> None:
        """Reserves memory for `graph` as the worst case (never shrinking the reserve)."""
    def supports(self, op: str, dst: str, srcs: Sequence[str], backend: str | None = None) -> bool:
        """Whether every backend (or the one called `backend`) implements `op` (e.g.
        "mul_mat") with result dtype `dst` over sources of dtypes `srcs`."""
    def stats(self) -> dict[str, dict[str, int]]: ...
    def counters(self) -> list[int]:
        """The counters summed over the backends, in `stat_names()` order: `stats()["total"]`
        as a list, cheap enough to take at every decode step."""
    def reset_stats(self) -> None:
        """Zeroes every counter and forgets the kernel times of `kernel_times()`."""
    def kernel_times(self) -> list[dict[str, Any]]:
        """Device time per kernel variant over the steps completed since `reset_stats()`,
        longest first: dicts with `backend`, `name`, `count`, `device_ns` and `read_bytes`.
        Empty unless a backend profiles its dispatches (Vulkan with `LOWSYNC_VK_PROFILE=1`)."""
    def synchronize(self) -> None: ...
