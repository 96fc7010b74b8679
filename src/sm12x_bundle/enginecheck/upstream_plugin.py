"""A pytest plugin (``-p sm12x_bundle.enginecheck.upstream_plugin``) for vLLM's own allocator tests.

Before collection imports the test module, it makes a vLLM source tree the ``vllm`` that
module imports (``--sm12x-tree``/``--sm12x-extension``: the tree first on sys.path, the
extension built from it first on vllm.__path__, empty placeholders for the compiled modules
a source tree lacks: selftest/loader.py's rules). Afterwards it writes, to
``--sm12x-result``, each test's outcome and what was imported: vllm's file, the cumem
extension cumem.py found, whether cumem was available, the placeholders made.

It also holds the stand-ins for what the test files import from vLLM's tests/utils.py
(upstream.py says why that file is not used).
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from sm12x_bundle.selftest import loader


def create_new_process_for_each_test(method: str | None = None):
    """Stand-in: upstream forks (or spawns) a process for each test; the runner already runs
    each test in a pytest process of its own, so the test runs as it is."""
    return lambda func: func


# Stand-in: upstream skips FP8 tests on GPUs without FP8; the only test that uses it loads a
# model, which the runner leaves out, so it never runs here.
requires_fp8 = pytest.mark.skip(reason="sm12x-bundle stand-in: FP8 tests load a model and are not run")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sm12x-bundle")
    group.addoption("--sm12x-result", metavar="FILE", help="write each test's outcome and what was imported, as JSON")
    group.addoption("--sm12x-tree", metavar="DIR", help="a vLLM source tree to import vllm from")
    group.addoption("--sm12x-extension", metavar="SO", help="the cumem extension built from that tree")


class Recorder:
    """Registered as a plugin of its own: collects each test's outcome, writes the result."""

    def __init__(self, result: Path | None):
        self.result = result
        self.outcomes: dict[str, dict] = {}
        self.placeholders = loader.CompiledPlaceholders()
        self.error: str | None = None
        self.vllm_file: str | None = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed and self.error is None:
            lines = str(report.longrepr).strip().splitlines()
            self.error = "collection failed: " + ("; ".join(lines[-3:]) if lines else report.nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seen = self.outcomes.setdefault(report.nodeid.split("::", 1)[-1], {"outcome": "passed", "detail": "", "seconds": 0.0})
        seen["seconds"] = round(seen["seconds"] + report.duration, 3)
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            seen.update(outcome="skipped", detail=reason)
        elif report.failed:
            seen.update(outcome="failed" if report.when == "call" else "error", detail=_crash(report))

    def pytest_sessionfinish(self) -> None:
        self.write()

    def write(self) -> None:
        if self.result is None:
            return
        cumem = sys.modules.get("vllm.device_allocator.cumem")
        vllm = sys.modules.get("vllm")
        doc = {
            "outcomes": self.outcomes,
            "error": self.error,
            "vllm_file": self.vllm_file or getattr(vllm, "__file__", None),
            "vllm_version": _installed_version(),
            "platform": _platform(),
            "extension": getattr(cumem, "lib_name", None),
            "cumem_available": getattr(cumem, "cumem_available", None),
            "placeholders": self.placeholders.names,
        }
        self.result.write_text(json.dumps(doc, indent=2))


def _installed_version() -> str | None:
    """The version vLLM finds for itself (importlib.metadata), which picks its platform."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _platform() -> str | None:
    """The platform vLLM resolved (CudaPlatform, UnspecifiedPlatform, ...), if it got that far."""
    platforms = sys.modules.get("vllm.platforms")
    try:
        return type(platforms.current_platform).__name__ if platforms is not None else None
    except Exception as exc:  # noqa: BLE001 - the report names it; the tests' own outcome is what counts
        return f"unresolved ({type(exc).__name__}: {exc})"


def _crash(report: pytest.TestReport) -> str:
    """The failure in one line: the exception and its message, where it was raised."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        lines = (report.longreprtext or "").strip().splitlines()
        return lines[-1] if lines else f"{report.when} failed"
    first = crash.message.strip().splitlines()[0] if crash.message.strip() else "failed"
    return f"{first} ({Path(crash.path).name}:{crash.lineno})"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    result = config.getoption("--sm12x-result")
    recorder = Recorder(Path(result) if result else None)
    config.pluginmanager.register(recorder, "sm12x-bundle-recorder")
    tree, extension = config.getoption("--sm12x-tree"), config.getoption("--sm12x-extension")
    if tree is None:
        return
    if extension is None:
        raise pytest.UsageError("--sm12x-tree needs --sm12x-extension (the cumem extension built from that tree)")
    try:
        recorder.vllm_file = loader.import_vllm(Path(tree), Path(extension), recorder.placeholders)
    except loader.LoadError as exc:
        recorder.error = str(exc)
        recorder.write()
        pytest.exit(f"sm12x-bundle: {exc}", returncode=3)
