"""A stand-in for ``python -m vllm.entrypoints.cli.main serve`` that needs no GPU.

It answers vLLM's endpoints as vLLM 0.21.0's server does in dev mode, so that the engine
check's serve driver (enginecheck/serve_session.py, endpoints.py) is tested for real over
HTTP: /health, /v1/completions, /sleep, /wake_up, /is_sleeping, /collective_rpc,
/reset_prefix_cache. Each rank is a process of its own (a sleeping child), so killing a
rank's pid makes /health fail. Behaviour is chosen by FAKE_SERVE (comma list):

  fail-sleep-rank-R   the first sleep answers HTTP 500 and logs an error that names rank R; the
                      scheduler stays paused, so /is_sleeping says true until a wake_up (vLLM's
                      EngineCore pauses before it sleeps and counts a paused scheduler as asleep)
  hang-wake           a wake never answers
  fail-wake           a wake answers HTTP 500 and the server stays asleep
  wedge-after-kill    once a rank is dead, /health still says 200 and every POST hangs (a wedged
                      engine), instead of answering 500
  exit-at-start       the server exits with code 1 before it is healthy
  stale-wake          a sleep after the first copies nothing (it says it skipped the weights),
                      so a wake restores the weights as they were at the first sleep: a weight
                      changed in place in between (sm12x_perturb) is lost

The "weights" are an offset every token moves by: sm12x_perturb changes it in place, a sleep
backs it up (and says what it copied and skipped, as the unchanged-skip's allocator does), a
wake restores the backup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def option(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


class State:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.ranks = int(option(argv, "--tensor-parallel-size", "1")) * int(option(argv, "--pipeline-parallel-size", "1"))
        self.model = option(argv, "--served-model-name", "model")
        self.flags = os.environ.get("FAKE_SERVE", "").split(",")
        self.asleep = False
        self.paused = False
        self.injected: dict[int, bool] = {}
        self.weights, self.backup, self.copied = 0, None, 0
        self.workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
                        for _ in range(self.ranks)]

    def healthy(self) -> bool:
        return all(w.poll() is None for w in self.workers)

    def says_healthy(self) -> bool:
        return self.healthy() or "wedge-after-kill" in self.flags

    def rpc(self, method: str, args: list[str]) -> list:
        out = []
        for rank, worker in enumerate(self.workers):
            if method == "sm12x_state":
                out.append({"rank": rank, "pid": worker.pid, "tags": {"weights": {
                    "allocations": 2, "bytes": 1 << 20, "asleep": 2 if self.asleep else 0, "backed_up_bytes": 0}},
                    "cumem_py": None, "extension": None, "last_sleep_copied_bytes": self.copied,
                    "last_sleep_skipped_bytes": (1 << 20) - self.copied})
            elif method == "sm12x_perturb":
                out.append({"rank": rank, "changed": "lm_head.weight", "rows_rolled": int(args[0])})
            elif method == "sm12x_inject":
                on = args[1] == "" or int(args[1]) == rank
                self.injected[rank] = on
                out.append({"installed": on, "rank": rank})
            elif method == "sm12x_uninject":
                out.append({"fired": self.injected.pop(rank, False), "rank": rank})
            elif method == "sm12x_pid":
                out.append({"rank": rank, "pid": worker.pid})
            elif method == "sm12x_maps":  # the string arguments, as collective_rpc passes them
                out.append({"rank": rank, "pid": worker.pid, "count": int(args[0]), "size": int(args[1]) << 20,
                            "best_s": {"extension create_and_map": 0.02}})
            elif method == "sm12x_gc":  # each rank's heap frozen after warm-up, as the patched series does
                out.append({"rank": rank, "pid": worker.pid, "seconds": 0.002 + 0.001 * rank, "frozen": 400_000})
            else:
                return None
        if method == "sm12x_perturb":
            self.weights += int(args[0])
        return out

    def sleep(self) -> None:
        """Back the weights up (stale-wake: only the first time; later ones skip the copy)."""
        stale = "stale-wake" in self.flags and self.backup is not None
        self.copied = 0 if stale else 1 << 20
        self.backup = self.backup if stale else self.weights
        self.asleep = True

    def wake(self) -> None:
        if self.backup is not None:
            self.weights = self.backup


def handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            print("fake serve:", args[0] % args[1:], file=sys.stderr, flush=True)

        def reply(self, code: int, doc=None) -> None:
            body = b"" if doc is None else json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length)) if length else {}

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == "/health":
                self.reply(200 if state.says_healthy() else 500)
            elif path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": state.model, "object": "model"}]})
            elif path == "/is_sleeping":
                self.reply(200, {"is_sleeping": state.asleep or state.paused})
            else:
                self.reply(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            path, query = url.path, urllib.parse.parse_qs(url.query)
            if not state.healthy():
                if "wedge-after-kill" in state.flags:
                    time.sleep(3600)
                print("ERROR EngineDeadError: EngineCore encountered an issue", file=sys.stderr, flush=True)
                return self.reply(500, {"error": "EngineDeadError"})
            if path == "/v1/completions":
                doc = self.body()
                if state.asleep:
                    return self.reply(500, {"error": "the engine is asleep"})
                if doc.get("model") != state.model:
                    return self.reply(404, {"error": f"model {doc.get('model')} does not exist"})
                toks = [[(sum(p) + i * 7 + state.weights) % 32000 for i in range(doc["max_tokens"])] for p in doc["prompt"]]
                return self.reply(200, {"choices": [{"index": i, "text": "", "token_ids": t} for i, t in enumerate(toks)]})
            if path == "/sleep":
                for flag in list(state.flags):
                    if flag.startswith("fail-sleep-rank-"):
                        state.flags.remove(flag)
                        state.paused = True
                        rank = flag.rsplit("-", 1)[1]
                        print(f"ERROR sleep failed on rank {rank} of ranks 0-{state.ranks - 1} (rank {rank}: "
                              f"tag 'weights', 1048576 bytes: out of host memory)", file=sys.stderr, flush=True)
                        return self.reply(500, {"error": "Internal Server Error"})
                state.sleep()
                return self.reply(200)
            if path == "/wake_up":
                if "hang-wake" in state.flags:
                    time.sleep(3600)
                if "fail-wake" in state.flags:
                    print("ERROR wake_up failed: out of memory (tag 'weights', 1048576 bytes)", file=sys.stderr, flush=True)
                    return self.reply(500, {"error": "Internal Server Error"})
                if not query.get("tags"):
                    state.asleep = False
                    state.wake()
                state.paused = False
                return self.reply(200)
            if path == "/reset_prefix_cache":
                return self.reply(200)
            if path == "/collective_rpc":
                doc = self.body()
                results = state.rpc(doc["method"], doc.get("args", []))
                if results is None:
                    return self.reply(500, {"error": f"method {doc['method']} not found"})
                return self.reply(200, {"results": results})
            self.reply(404, {"detail": "Not Found"})

    return Handler


def main() -> None:
    argv = sys.argv[1:]
    assert argv[0] == "serve", argv
    print("fake serve: argv " + json.dumps(argv), file=sys.stderr, flush=True)
    if "exit-at-start" in os.environ.get("FAKE_SERVE", ""):
        print("ERROR RuntimeError: CUDA out of memory while loading", file=sys.stderr, flush=True)
        sys.exit(1)
    state = State(argv)
    server = ThreadingHTTPServer((option(argv, "--host", "127.0.0.1"), int(option(argv, "--port", "8000"))),
                                 handler(state))
    server.serve_forever()


if __name__ == "__main__":
    main()
