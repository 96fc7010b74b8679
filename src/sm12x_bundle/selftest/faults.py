"""Failures injected into a tree's own cumem.py without editing it: a pinned backup
that cannot be allocated, a map that runs out of memory."""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

class HostAllocationFails:
    """Stands in for ``torch`` in the tree's cumem.py: its k-th CPU ``torch.empty`` (the
    pinned backup that sleep() takes) raises as a pinned host allocation does when host
    memory runs out. Keeps a weak reference to every backup, to tell when all are gone."""

    def __init__(self, torch, k: int | None = None) -> None:
        self.torch, self.k, self.calls, self.made = torch, k, 0, []

    def __getattr__(self, name):
        return getattr(self.torch, name)

    def empty(self, *args, **kwargs):
        if kwargs.get("device") != "cpu":
            return self.torch.empty(*args, **kwargs)
        self.calls += 1
        if self.k is not None and self.calls == self.k:
            raise RuntimeError(f"injected: pinned host allocation {self.k} failed (out of memory)")
        backup = self.torch.empty(*args, **kwargs)
        self.made.append(weakref.ref(backup))
        return backup

    def alive(self) -> int:
        """Backups still held (collected first)."""
        gc.collect()
        self.made = [r for r in self.made if r() is not None]
        return len(self.made)


@contextmanager
def failing_host_allocation(torch, cumem, k: int | None):
    host = HostAllocationFails(torch, k)
    cumem.torch = host
    try:
        yield host
    finally:
        cumem.torch = torch


class MapFails:
    """Stands in for cumem.py's create_and_map: the k-th call raises as a map out of
    memory does, before it creates anything."""

    def __init__(self, real, k: int) -> None:
        self.real, self.k, self.calls = real, k, 0

    def __call__(self, handle) -> None:
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError(f"injected: map {self.k} failed (out of memory)")
        self.real(handle)


@contextmanager
def failing_map(cumem, k: int):
    real = cumem.create_and_map
    cumem.create_and_map = MapFails(real, k)
    try:
        yield
    finally:
        cumem.create_and_map = real
