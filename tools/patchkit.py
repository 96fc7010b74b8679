"""Build small git-format-patch files from before/after text (pure Python): for the tests,
and for the example series the golden image files are rendered from (tools/golden/image.py)."""

from __future__ import annotations

import difflib
from pathlib import Path

HEADERS = {
    "Description": "test patch",
    "Origin": "https://github.com/vllm-project/vllm/pull/1",
    "Forwarded": "no",
    "Applied-Upstream": "no",
    "Last-Update": "2026-11-21",
    "Sm12x-Kind": "python",
}


def make_patch(changes: dict[str, tuple[str | None, str | None]], subject: str = "test", **headers: str) -> str:
    """``changes``: path -> (old text or None for a new file, new text or None for deletion)."""
    merged = dict(HEADERS)
    merged.update({k.replace("_", "-"): v for k, v in headers.items()})
    lines = [
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001",
        "From: tests <tests@example.invalid>",
        "Date: Sat, 21 Nov 2026 00:00:00 +0000",
        f"Subject: [PATCH] {subject}",
        "",
    ]
    for key, value in merged.items():
        for v in value.split("\n"):
            lines.append(f"{key}: {v}")
    lines += ["---", ""]
    for path, (old, new) in changes.items():
        lines.append(f"diff --git a/{path} b/{path}")
        if old is None:
            lines.append("new file mode 100644")
        if new is None:
            lines.append("deleted file mode 100644")
        diff = difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{path}",
            "/dev/null" if new is None else f"b/{path}",
            n=3,
        )
        lines.extend(line.rstrip("\n") for line in diff)
    return "\n".join(lines) + "\n"


def write_series(folder: Path, patches: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in patches.items():
        (folder / name).write_text(text)
    series = folder / "series"
    series.write_text("".join(f"{name}\n" for name in patches))
    return series
