"""What the check runs inside every worker of a ``vllm serve``: vLLM mixes this class into
its worker (``--worker-extension-cls sm12x_bundle.enginecheck.probe.Probe``), and
``POST /collective_rpc`` calls a method by name on every rank with string arguments
(vLLM 0.21.0 ``entrypoints/serve/rpc/api_router.py``). Each method is inject.py's function
for this worker, so the Python-API session and the server run the same code inside the
engine; the reply carries the rank, so the check can tell the ranks apart.

Importable with the standard library alone (the worker imports it by name at start).
"""

from __future__ import annotations

from . import inject


class Probe:
    """Methods vLLM adds to its worker; ``self`` is the worker."""

    def sm12x_state(self) -> dict:
        return inject.allocator_state(self)

    def sm12x_inject(self, at: str = "middle", rank: str = "") -> dict:
        """The host-memory fault on ``rank`` alone ("": every rank)."""
        return inject.install_on_rank(self, at, rank)

    def sm12x_uninject(self) -> dict:
        return {**inject.remove_host_failure(self), "rank": int(getattr(self, "rank", 0))}

    def sm12x_reload_dummy(self) -> dict:
        return inject.reload_dummy_weights(self)

    def sm12x_perturb(self, seed: str = "1") -> dict:
        """A weight changed in place (scenario g)."""
        return inject.perturb_weights(self, seed)

    def sm12x_pid(self) -> dict:
        return inject.worker_pid(self)

    def sm12x_gc(self) -> dict:
        """One gc.collect() in this worker, timed (scenario a)."""
        return inject.gc_collect_time(self)

    def sm12x_maps(self, count: str = "200", size_mib: str = "12", only_rank: str = "") -> dict:
        """The driver's map calls on ranges of this worker's own, timed (scenario c)."""
        return inject.map_call_times(self, count, size_mib, only_rank)
