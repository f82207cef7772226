"""Shared fixtures and collection rules of the Python suite.

Device markers: a test marked `cuda` or `vulkan` runs only when `lowsync.available_backends()`
lists that device; otherwise it is skipped with the reason — except that with
`LOWSYNC_REQUIRE_CUDA=1` (set on the GPU machine) or `LOWSYNC_REQUIRE_VULKAN=1` (set by
`.ci/run`) a missing device of that kind fails the test instead. A test marked `vulkan_gpu`
also needs the Vulkan device to be a GPU: a real model takes minutes per token on a software
rasteriser such as lavapipe (CI's Vulkan), so there it is skipped with that reason.
"""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, settings

import lowsync as ls
from lowsync._native import device_type

# Computes take milliseconds to seconds depending on the machine's load: no deadlines, and no
# example database written into the work tree.
settings.register_profile(
    "lowsync",
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("lowsync")

# A shell without job control starts a background job (`cmd &`, `nohup ... &`) with SIGINT
# ignored, and then `_thread.interrupt_main` (the Ctrl-C tests' simulated interrupt) does
# nothing: those tests fail, or wait forever for an interrupt that never lands. Python's own
# handler makes it land again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Backends every machine has; the op suite runs on each.
CPU_BACKENDS = ("cpu", "cpu-async")


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    assert name in ls.available_backends(), f"{name} must always be available"
    return name


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Removes every LOWSYNC_* variable, so a developer's shell cannot change a test."""
    for var in list(os.environ):
        if var.startswith("LOWSYNC_"):
            monkeypatch.delenv(var)
    return monkeypatch


def _has_device(prefix: str) -> bool:
    return any(b == prefix or b.startswith(prefix + ":") for b in ls.available_backends())


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vulkan_gpu") is not None:
        gpus = [
            b for b in ls.available_backends() if b.startswith("vulkan") and device_type(b) != "cpu"
        ]
        if not gpus:
            pytest.skip("no Vulkan GPU on this machine (a software rasteriser is too slow)")
    for marker, name, var in (
        ("cuda", "CUDA", "LOWSYNC_REQUIRE_CUDA"),
        ("vulkan", "Vulkan", "LOWSYNC_REQUIRE_VULKAN"),
    ):
        if item.get_closest_marker(marker) is not None and not _has_device(marker):
            if os.environ.get(var) == "1":
                pytest.fail(f"{var}=1 but lowsync lists no {name} device")
            pytest.skip(f"no {name} device on this machine")
