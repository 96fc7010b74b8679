"""``engine-check``: the fixes shown inside vLLM's own engine, where operators run it.

The check starts ``vllm serve`` driven over HTTP (the default driver, as operators run it:
CUDA graphs, any TP x PP) or ``vllm.LLM`` (``--driver api``) from an installed vLLM, on a Llama-shaped model it writes itself (dummy weights, no hub,
no tokenizer), and drives it through sleep/wake cycles, level 2, a rotation of two
engines, failures injected inside the engine, and the seeds' cross-image sequence.
``--compare`` runs each scenario on the install as it is and on a copy of it patched by
the lane's series. The folders are the layers:

* what runs, decided first: ``install`` (which vLLM, which lane), ``gpu`` (NVML, no CUDA
  context in the parent), ``model`` (the model folder and its size), ``plan`` (scenarios,
  sizes), ``releases`` (the few API differences between the lanes);
* the patched copy: ``copies``;
* the processes: ``procs`` (the one place that starts long-lived children, each in its own
  process group), ``protocol`` (the JSON lines they speak), ``session`` (one engine through
  the Python API), ``serve_session`` (one ``vllm serve`` behind the same JSON lines),
  ``endpoints`` (the server's HTTP endpoints), ``probe`` (the worker extension that
  ``/collective_rpc`` calls), ``inject`` (what runs inside the engine's workers), ``holder`` (another process holding GPU
  memory), ``ceilings`` (the pinned-copy ceilings), ``hostmem`` (/proc);
* the scenarios: ``bench``, ``scenarios``, ``rotation`` (its swaps as ``swap`` makes them,
  which is also ``sm12x-bundle rotate``), ``failures``;
* the outcome: ``targets``, ``report`` (verdict, JSON), ``table`` (text); ``runner`` ties
  them together and ``command`` is the CLI;
* vLLM's own allocator tests from each lane's pinned sdist: ``upstream`` (which tests, run
  each in its own process) and ``upstream_plugin`` (a source tree made importable under
  pytest);
* getting vLLM onto a GPU machine without network: ``payload`` (pinned wheels, slimmed,
  packed and split under the carry limit; unpacking uses the standard library alone) and
  ``trees`` (each lane's pristine and patched source tree, packed the same way).
"""
