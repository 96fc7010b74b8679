"""A vLLM server's HTTP endpoints, as the operators drive them (standard library only).

Sleep, wake and state are vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``):
``POST /sleep?level=N``, ``POST /wake_up[?tags=T]``, ``GET /is_sleeping``,
``POST /collective_rpc`` (a worker method by name, string arguments, one result per rank)
and ``POST /reset_prefix_cache``; serving is ``POST /v1/completions`` with token-id prompts
(``return_token_ids``: no tokenizer needed) and health is ``GET /health``. Read in vLLM
0.21.0's ``entrypoints/serve/{sleep,rpc,cache}/api_router.py`` and
``entrypoints/openai/completion/protocol.py``.

Every request is bounded by a timeout; a refused connection, a timeout or an HTTP error is
:class:`HttpError` with one sentence, never a hang.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

BODY_LIMIT = 2000  # characters of an error body kept


class HttpError(Exception):
    """A request that did not succeed: ``status`` is the HTTP status, 0 when none came."""

    def __init__(self, words: str, status: int = 0, timed_out: bool = False) -> None:
        super().__init__(words)
        self.status, self.timed_out = status, timed_out


class Server:
    """One vLLM server at ``base`` (e.g. ``http://127.0.0.1:8000``)."""

    def __init__(self, base: str, model: str | None = None) -> None:
        self.base, self.model = base.rstrip("/"), model

    def request(self, method: str, path: str, timeout: float, body: dict | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")[:BODY_LIMIT]
            raise HttpError(f"{method} {path}: HTTP {exc.code}: {text.strip() or exc.reason}", exc.code) from None
        except (socket.timeout, TimeoutError):
            raise HttpError(f"{method} {path}: no answer within {timeout:.0f} s", timed_out=True) from None
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise HttpError(f"{method} {path}: no answer within {timeout:.0f} s", timed_out=True) from None
            raise HttpError(f"{method} {path}: {reason}") from None

    def json(self, method: str, path: str, timeout: float, body: dict | None = None):
        _, raw = self.request(method, path, timeout, body)
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise HttpError(f"{method} {path}: not JSON: {raw[:200]!r}") from None

    def healthy(self, timeout: float = 10.0) -> bool:
        try:
            status, _ = self.request("GET", "/health", timeout)
        except HttpError:
            return False
        return status == 200

    def sleep(self, level: int, timeout: float) -> None:
        self.request("POST", f"/sleep?level={int(level)}", timeout)

    def wake_up(self, timeout: float, tags: list[str] | None = None) -> None:
        query = "?" + urllib.parse.urlencode([("tags", t) for t in tags]) if tags else ""
        self.request("POST", f"/wake_up{query}", timeout)

    def is_sleeping(self, timeout: float) -> bool:
        return bool(self.json("GET", "/is_sleeping", timeout)["is_sleeping"])

    def rpc(self, method: str, timeout: float, *args: str) -> list:
        """A worker method on every rank; one result per rank, in rank order."""
        doc = self.json("POST", "/collective_rpc", timeout, {"method": method, "args": list(map(str, args))})
        return (doc or {}).get("results", [])

    def reset_prefix_cache(self, timeout: float) -> None:
        self.request("POST", "/reset_prefix_cache", timeout)

    def complete(self, prompts: list[list[int]], max_tokens: int, timeout: float) -> list[list[int]]:
        """Greedy tokens for each token-id prompt, in prompt order."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        doc = self.json("POST", "/v1/completions", timeout, body)
        choices = sorted(doc.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts) or any(c.get("token_ids") is None for c in choices):
            raise HttpError(f"POST /v1/completions: {len(choices)} choices with token ids for {len(prompts)} prompts")
        return [list(c["token_ids"]) for c in choices]
