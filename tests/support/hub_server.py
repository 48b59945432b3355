"""A Hugging Face Hub on this machine (loopback only), in the shape of the Hub's file API, counting what it serves.

``GET|HEAD /{org}/{name}/resolve/{revision}/{file}``, as huggingface_hub's ``hf_hub_url`` spells it, with the
headers ``get_hf_file_metadata`` reads (``X-Repo-Commit``, ``ETag``, ``Content-Length``), HTTP range requests
(``Range: bytes=a-b`` -> 206 with ``Content-Range``) and the Hub's error codes (``X-Error-Code``:
``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), which huggingface_hub turns into its exceptions.
"""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

_PATH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class HubServer:
    """Serve ``repos`` (repo_id -> (folder, 40-hex commit)); ``served[file]`` counts the body bytes sent of each
    file, ``requests`` lists ``(method, path, range header)``. A context manager; ``endpoint`` is its URL."""

    def __init__(self, repos: dict[str, tuple[Path, str]]):
        self.repos = repos
        self.served: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                server._answer(self, body=False)

            def do_GET(self):
                server._answer(self, body=True)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._http.shutdown()
        self._http.server_close()

    def _error(self, handler, code: str) -> None:
        handler.send_response(404)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _answer(self, handler, body: bool) -> None:
        self.requests.append((handler.command, handler.path, handler.headers.get("Range")))
        match = _PATH.match(unquote(handler.path.split("?")[0]))
        if match is None or match["repo"] not in self.repos:
            return self._error(handler, "RepoNotFound")
        folder, commit = self.repos[match["repo"]]
        if match["rev"] not in ("main", commit):
            return self._error(handler, "RevisionNotFound")
        path = folder / match["file"]
        if "/" in match["file"] or not path.is_file():
            return self._error(handler, "EntryNotFound")
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        ranged = _RANGE.match(handler.headers.get("Range") or "")
        if ranged:
            start = int(ranged[1])
            end = min(int(ranged[2]) if ranged[2] else size - 1, size - 1)
            status = 206
        handler.send_response(status)
        handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", '"' + hashlib.sha256(f"{path.name}:{size}".encode()).hexdigest() + '"')
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(end - start + 1 if status == 206 else size))
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        handler.end_headers()
        if not body:
            return
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start + 1)
        handler.wfile.write(data)
        self.served[match["file"]] = self.served.get(match["file"], 0) + len(data)
