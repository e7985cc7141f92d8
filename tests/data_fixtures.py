"""Helpers for the data tests: random documents in shards, small schedules, a plain reference loader."""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from nanogpt_pl.data.shards import write_shard
from nanogpt_pl.schedule import Schedule, Stage

BOS = 50256


def random_documents(rng: np.random.Generator, n_docs: int, mean_len: float, vocab: int = 50256) -> list[np.ndarray]:
    """Documents of geometric lengths (>= 1 token after the BOS), ids in [0, vocab) without BOS."""
    docs = []
    for _ in range(n_docs):
        n = int(rng.geometric(1.0 / mean_len))
        body = rng.integers(0, vocab, size=n, dtype=np.int64)
        body[body == BOS] = BOS - 1
        docs.append(np.concatenate([[BOS], body]).astype(np.uint16))
    return docs


def write_random_shards(
    directory: Path, seed: int, n_shards: int, docs_per_shard: int, mean_len: float, name: str = "rand"
) -> list[Path]:
    """``n_shards`` train shards of random documents; the first shard may start mid-document."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n_shards):
        tokens = np.concatenate(random_documents(rng, docs_per_shard, mean_len))
        if i == 1:
            # a shard that starts inside a document (as when a document straddles shards)
            tokens = np.concatenate([rng.integers(0, BOS, size=7).astype(np.uint16), tokens])
        paths.append(write_shard(directory / f"{name}_train_{i + 1:06d}.bin", tokens))
    return paths


def small_schedule(stages: list[tuple[int, int, int, int]], attention_cap=None) -> Schedule:
    """A schedule of (steps, batch_tokens, seq_len, max_doc_len) stages."""
    return Schedule(
        stages=[Stage(steps=s, batch_tokens=b, seq_len=t, max_doc_len=m) for s, b, t, m in stages],
        attention_cap=attention_cap,
        untie_step=None,
    )


def read_tokens(path: Path) -> np.ndarray:
    raw = np.fromfile(path, dtype=np.uint16)
    return raw[512:]  # 1024-byte header = 512 uint16


def reference_slices(shard_tokens: list[np.ndarray], schedule: Schedule, steps: int):
    """Plain-Python walk of the record's loop: per step, the list of (tokens, piece lengths) slices.

    Every slice takes documents from the next unused BOS; a piece ends at the next BOS, the
    document cap, or the tokens still needed; when a shard runs out the step restarts in the
    next shard.
    """
    shard_i, idx = 0, 0
    out = []
    for step in range(steps):
        T = schedule.seq_len(step)
        n = schedule.batch_tokens(step) // T
        cap = schedule.max_doc_len(step)
        while True:
            tokens = shard_tokens[shard_i]
            bos = [int(i) for i in np.flatnonzero(tokens == BOS)]
            j, slices, ok = idx, [], True
            for _ in range(n):
                pieces, lens, cur = [], [], 0
                while cur <= T:
                    if j >= len(bos):
                        ok = False
                        break
                    b = bos[j]
                    j += 1
                    end = min(bos[j] if j < len(bos) else len(tokens), b + cap, b + T - cur + 1)
                    pieces.append(tokens[b:end])
                    lens.append(end - b)
                    cur += end - b
                if not ok:
                    break
                slices.append((np.concatenate(pieces), lens))
            if ok:
                idx = j
                out.append(slices)
                break
            shard_i, idx = shard_i + 1, 0
            if shard_i >= len(shard_tokens):
                raise RuntimeError("reference: data exhausted")
    return out


COMMIT = "0123456789abcdef0123456789abcdef01234567"
PATH_RE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>[^?]+)")


class FakeHub:
    """A fake of the Hugging Face hub's file endpoints for one dataset repo, on localhost.

    Serves ``HEAD``/``GET /datasets/<repo>/resolve/<revision>/<file>`` with the headers
    huggingface_hub's ``hf_hub_download`` reads (``X-Repo-Commit``, ``ETag``,
    ``Content-Length``; byte ranges for resumed transfers; ``X-Error-Code`` on 404) and
    records every request.
    """

    def __init__(self, files: dict[str, bytes], repo: str = "kjj0/fineweb10B-gpt2"):
        self.files = files
        self.repo = repo
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _serve(self, body: bool) -> None:
                hub.requests.append((self.command, self.path))
                m = PATH_RE.match(self.path)
                if not m or m["repo"] != hub.repo or m["file"] not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if m else "RepoNotFound")
                    self.send_header("X-Error-Message", "Entry not found")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = hub.files[m["file"]]
                start = 0
                rng = self.headers.get("Range")
                if rng and body:
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if body:
                    self.wfile.write(data[start:])

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def gets(self) -> list[str]:
        return sorted(PATH_RE.match(p)["file"] for c, p in self.requests if c == "GET")

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
