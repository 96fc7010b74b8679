"""The GPU as NVML sees it, through ctypes: the parent never creates a CUDA context.

NVML reads the card, the driver and the device's memory (used by every process) without
touching CUDA, so the parent can size the model before any engine starts, watch what a
sleep frees, and check after every scenario that the memory its processes held is back.
The device is the first one CUDA_VISIBLE_DEVICES names (an index in PCI order, which the
children are given too, or a GPU UUID), else index 0.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

from ..errors import EnvironmentProblem

LIBRARY = "libnvidia-ml.so.1"
# The children count devices in the same (PCI bus) order as NVML does.
DEVICE_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@dataclass(frozen=True)
class Card:
    index: int
    name: str
    driver: str
    total_bytes: int
    free_bytes: int
    used_bytes: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Nvml:
    """One NVIDIA device through libnvidia-ml; every failure is one sentence (EnvironmentProblem)."""

    def __init__(self, library: str = LIBRARY, visible: str | None = None) -> None:
        try:
            self.lib = ctypes.CDLL(library)
        except OSError as exc:
            raise EnvironmentProblem(
                f"no NVIDIA driver here: {library} cannot be loaded ({exc}); the engine check needs an NVIDIA GPU "
                "and its driver"
            ) from None
        self.lib.nvmlErrorString.restype = ctypes.c_char_p
        self._call("nvmlInit_v2", what="NVML did not start")
        self.handle, self.index = self._device(os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible)

    def _call(self, name: str, *args, what: str) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise EnvironmentProblem(f"{what}: {name} says {self.lib.nvmlErrorString(rc).decode()} (NVML error {rc})")

    def _device(self, visible: str | None) -> tuple[ctypes.c_void_p, int]:
        count = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(count), what="NVML cannot count the GPUs")
        raw = "0" if visible is None else visible.strip()  # set but empty: CUDA sees no device
        first = raw.split(",")[0].strip()
        if count.value == 0 or not first or first == "-1":
            shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            raise EnvironmentProblem(f"no GPU to test on: NVML finds {count.value} device(s){shown}")
        handle = ctypes.c_void_p()
        if first.isdigit():
            self._call("nvmlDeviceGetHandleByIndex_v2", int(first), ctypes.byref(handle),
                       what=f"GPU {first} (CUDA_VISIBLE_DEVICES) is not there")
            return handle, int(first)
        self._call("nvmlDeviceGetHandleByUUID", first.encode(), ctypes.byref(handle),
                   what=f"GPU {first} (CUDA_VISIBLE_DEVICES) is not there")
        index = ctypes.c_uint()
        self._call("nvmlDeviceGetIndex", handle, ctypes.byref(index), what="NVML cannot index the GPU")
        return handle, index.value

    def memory(self) -> tuple[int, int, int]:
        """(total, free, used) bytes of the device, all processes together."""
        mem = _Memory()
        self._call("nvmlDeviceGetMemoryInfo", self.handle, ctypes.byref(mem), what="NVML cannot read the GPU's memory")
        return mem.total, mem.free, mem.used

    def used(self) -> int:
        return self.memory()[2]

    def card(self) -> Card:
        name, driver = ctypes.create_string_buffer(96), ctypes.create_string_buffer(96)
        self._call("nvmlDeviceGetName", self.handle, name, 96, what="NVML cannot name the GPU")
        self._call("nvmlSystemGetDriverVersion", driver, 96, what="NVML cannot read the driver version")
        total, free, used = self.memory()
        return Card(self.index, name.value.decode(), driver.value.decode(), total, free, used)

    def wait_used_at_most(self, limit: int, timeout: float, poll: float = 0.2) -> int:
        """Poll until the device's used memory is at most ``limit``; return the last reading."""
        return wait_used_at_most(self.used, limit, timeout, poll)


def wait_used_at_most(used_now, limit: int, timeout: float, poll: float = 0.2) -> int:
    """Poll ``used_now()`` until it is at most ``limit``; return the last reading."""
    deadline = time.monotonic() + timeout
    used = used_now()
    while used > limit and time.monotonic() < deadline:
        time.sleep(poll)
        used = used_now()
    return used


class Gpus:
    """The GPUs one engine spreads over (TP x PP ranks; rank i on the i-th visible device),
    read together: memory in use is their sum, free memory the least free of them."""

    def __init__(self, count: int = 1, visible: str | None = None, library: str = LIBRARY) -> None:
        raw = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        names = [n.strip() for n in raw.split(",")] if raw is not None else [str(i) for i in range(count)]
        if len(names) < count:
            raise EnvironmentProblem(f"an engine of {count} GPUs (TP x PP) needs {count} visible devices, and "
                                     f"CUDA_VISIBLE_DEVICES={raw!r} names {len(names)}")
        self.devices = [Nvml(library, visible=name) for name in names[:count]]
        if len({d.index for d in self.devices}) < count:
            raise EnvironmentProblem(f"NVML finds fewer than {count} distinct GPUs for an engine of {count} ranks")

    def index_of(self, rank: int) -> int:
        return self.devices[rank].index

    def used(self) -> int:
        return sum(d.used() for d in self.devices)

    def used_each(self) -> list[int]:
        return [d.used() for d in self.devices]

    def card(self) -> Card:
        """The first device, with the least free memory of all of them (what sizes must fit)."""
        first = self.devices[0].card()
        free = min(d.memory()[1] for d in self.devices)
        return Card(first.index, first.name, first.driver, first.total_bytes, free, self.used())

    def cards(self) -> list[dict]:
        return [d.card().to_dict() for d in self.devices]

    def wait_used_at_most(self, limit: int, timeout: float, poll: float = 0.2) -> int:
        return wait_used_at_most(self.used, limit, timeout, poll)
