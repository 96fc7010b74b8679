"""Another process that holds GPU memory while an engine sleeps (started by the check):

    python -m sm12x_bundle.enginecheck.holder

It speaks the protocol: ``hold`` with ``leave_bytes`` takes device memory with the CUDA
driver API (cuMemAlloc, through ctypes: no torch needed, a second or so to start) until
only that much is free, and answers how much it holds; ``exit`` lets it all go by ending
the process. The device is CUDA's device 0 under the CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER the check gives it, the same GPU the engines use.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

from . import protocol

CHUNK = 256 << 20
SMALL = 2 << 20


class Driver:
    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.check(self.cuda.cuInit(0), "cuInit")
        device, self.context = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self.check(self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device), "cuDevicePrimaryCtxRetain")
        self.check(self.cuda.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    @staticmethod
    def check(rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} failed with CUDA error {rc}")

    def free_bytes(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(self.cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value

    def take(self, nbytes: int) -> bool:
        ptr = ctypes.c_uint64()
        return self.cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0


def hold(driver: Driver, leave_bytes: int) -> dict:
    """Take memory in 256 MiB pieces, then 2 MiB ones, until at most ``leave_bytes`` are free."""
    held = 0
    for piece in (CHUNK, SMALL):
        while driver.free_bytes() - piece >= leave_bytes and driver.take(piece):
            held += piece
    return {"held_bytes": held, "free_bytes": driver.free_bytes()}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        driver = Driver()
    except (OSError, RuntimeError) as exc:
        replies.write(protocol.encode(protocol.failed_start(exc)))
        replies.flush()
        os._exit(0)
    replies.write(protocol.encode(protocol.ready(pid=os.getpid(), free_bytes=driver.free_bytes())))
    replies.flush()
    for line in sys.stdin:
        start = time.perf_counter()
        try:
            cmd, args = protocol.parse_request(line)
            data = hold(driver, int(args["leave_bytes"])) if cmd == "hold" else {}
            reply = protocol.ok(time.perf_counter() - start, **data)
        except (protocol.ProtocolError, KeyError, ValueError, RuntimeError) as exc:
            cmd, reply = None, protocol.failed_reply(time.perf_counter() - start, exc)
        replies.write(protocol.encode(reply))
        replies.flush()
        if cmd == "exit":
            break
    os._exit(0)  # the driver releases the process's memory with it


if __name__ == "__main__":
    main()
