"""Find a release file (an sdist, a wheel) and its sha256 in a PEP 503 / PEP 691 simple index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser

from ..errors import FetchError

PYPI = "https://pypi.org/simple"
_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


def index_url(configured: str | None = None) -> str:
    """The configured index, else pip's (PIP_INDEX_URL, then pip config), else PyPI."""
    if configured:
        return configured
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    return _pip_config_index() or PYPI


def _pip_config_index() -> str | None:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    value = proc.stdout.strip()
    return value if proc.returncode == 0 and value else None


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _get(url: str) -> tuple[bytes, str]:
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read(), response.headers.get_content_type() or ""
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"cannot read the package index {url}: {reason}") from None


def _links(body: bytes, content_type: str, page_url: str) -> dict[str, tuple[str, str | None]]:
    """filename -> (absolute url, sha256 or None) for every file the page lists."""
    out: dict[str, tuple[str, str | None]] = {}
    if content_type.endswith("json"):
        for f in json.loads(body).get("files", []):
            url = urllib.parse.urljoin(page_url, f["url"])
            out[f["filename"]] = (url.split("#", 1)[0], f.get("hashes", {}).get("sha256"))
        return out
    parser = _Links()
    parser.feed(body.decode("utf-8", "replace"))
    for href in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        out[name] = (url, sha)
    return out


def find_sdist(index: str, filename: str) -> tuple[str, str | None]:
    """Return (url, sha256 the index lists) for ``filename`` of project vllm."""
    return find_file(index, "vllm", filename)


def find_file(index: str, project: str, filename: str) -> tuple[str, str | None]:
    """Return (url, sha256 the index lists) for ``filename`` of ``project``."""
    page = index.rstrip("/") + f"/{project}/"
    if page.startswith("file:") and not page.endswith("index.html"):
        page += "index.html"
    body, content_type = _get(page)
    links = _links(body, content_type, page)
    if filename not in links:
        raise FetchError(f"{filename} is not listed in {page}: is the version right?")
    return links[filename]
