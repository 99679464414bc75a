"""A Hugging Face Hub on 127.0.0.1 for tests: dataset and model repos served from local folders,
answering the few endpoints `huggingface_hub` uses to list and download them, and recording every
request.

    GET  /api/datasets/OWNER/NAME[/revision/REV]         the commit main or REV is at (repo_info)
    GET  /api/datasets/OWNER/NAME/tree/REV[/PATH]        files with sizes (list_repo_tree)
    HEAD /datasets/OWNER/NAME/resolve/REV/PATH           ETag, X-Repo-Commit, Content-Length
    GET  /datasets/OWNER/NAME/resolve/REV/PATH           the bytes, a Range of them with 206

and a model repo's the same, under /api/models/OWNER/NAME... and /OWNER/NAME/resolve/REV/PATH
(a model's files are addressed without a type prefix).

REV is a revision's name or its commit; a repo has "main" alone, or the revisions it is given,
each with files and a commit of its own. A name may hold slashes ("refs/convert/parquet", where
the Hub keeps a dataset's Parquet conversion): the client sends it quoted as one segment
(refs%2Fconvert%2Fparquet), so paths are split before they are unquoted. An unknown revision is
a 404 RevisionNotFound, as the Hub answers.

Files are served as the Hub serves a regular (non-Xet) file: no X-Xet-* header and no Xet hash in
the listing, so the client downloads them over plain HTTP. Anything else is a 404.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class Request:
    method: str
    path: str  # unquoted, without the query
    headers: dict[str, str]  # names lowercased
    raw: str  # the path as sent, still quoted: where a revision's slashes are not separators

    @property
    def file(self) -> str | None:
        """The repo file a resolve request is for (OWNER/NAME:PATH), else None."""
        m = RESOLVE.fullmatch(self.raw)
        return f"{unquote(m[2])}:{unquote(m[4])}" if m else None

    @property
    def revision(self) -> str | None:
        """The revision (a name or a commit) a resolve request is for, else None."""
        m = RESOLVE.fullmatch(self.raw)
        return unquote(m[3]) if m else None

    @property
    def repo_type(self) -> str | None:
        """"datasets" or "models": the kind of repo an API or resolve request is for."""
        if m := re.match(r"/api/(datasets|models)/", self.raw):
            return m[1]
        if m := RESOLVE.fullmatch(self.raw):
            return m[1] or "models"
        return None


RESOLVE = re.compile(r"/(?:(datasets)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
API = re.compile(r"/api/(?:datasets|models)/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(?:/(.*))?)?")


class FakeHub:
    """`repos`: "OWNER/NAME" → the folder whose files are the dataset repo's at "main", or a dict
    {revision: folder} for a repo with other revisions; `models` the same for model repos.

    `drop_once`: "OWNER/NAME:PATH" → how many bytes of that file the first GET of it sends before
    the connection is closed under it (a download cut midway); later GETs are answered whole."""

    def __init__(self, repos: dict[str, Path | dict[str, Path]], drop_once: dict[str, int] | None = None,
                 models: dict[str, Path | dict[str, Path]] | None = None):
        self.repos = {name: self._revisions(folders) for name, folders in repos.items()}
        self.models = {name: self._revisions(folders) for name, folders in (models or {}).items()}
        self.drop_once = dict(drop_once or {})
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client expects of the Hub

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):  # the requests are recorded, not printed
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @classmethod
    def _revisions(cls, folders: Path | dict[str, Path]) -> dict[str, dict]:
        folders = folders if isinstance(folders, dict) else {"main": folders}
        return {revision: cls._index(revision, folder) for revision, folder in folders.items()}

    @staticmethod
    def _index(revision: str, folder: Path) -> dict:
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        digests = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in files.items()}
        # The revision's name is part of its commit: two revisions with the same files still have
        # commits of their own, so a request by commit says whose files to serve.
        commit = hashlib.sha1(json.dumps([revision, digests], sort_keys=True).encode()).hexdigest()
        return {"files": files, "sha256": digests, "commit": commit}

    @staticmethod
    def _at(repo: dict[str, dict], revision: str) -> dict | None:
        """The repo's files at `revision`, a name or a commit; None for one it does not have."""
        return repo.get(revision) or next((r for r in repo.values() if r["commit"] == revision), None)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def commit(self, repo: str, revision: str = "main") -> str:
        return {**self.models, **self.repos}[repo][revision]["commit"]

    def got(self, repo: str) -> list[str]:
        """The paths in `repo` whose bytes were asked for (GET, not HEAD), in the order asked."""
        with self.lock:
            return [r.file.split(":", 1)[1] for r in self.requests
                    if r.method == "GET" and r.file and r.file.startswith(repo + ":")]

    def _table(self, req: Request) -> dict:
        return self.models if req.repo_type == "models" else self.repos

    # ------------------------------------------------------------------------------ answers
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlsplit(h.path)
        req = Request(h.command, unquote(url.path), {k.lower(): v for k, v in h.headers.items()}, url.path)
        with self.lock:
            self.requests.append(req)
        table = self._table(req)
        api = API.fullmatch(req.raw)
        name = unquote(api[1]) if api else None
        if api and name not in table:  # as the Hub answers for a missing, private or gated repo
            return self._json(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        if api and body:
            revision = unquote(api[3]) if api[3] else "main"
            if (repo := self._at(table[name], revision)) is None:
                return self._revision_not_found(h)
            if api[2] in (None, "revision"):
                return self._json(h, 200, {"id": name, "sha": repo["commit"], "private": False,
                                           "siblings": [{"rfilename": n} for n in repo["files"]]})
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() == "true"
            return self._json(h, 200, self._tree(repo, unquote(api[4] or "").strip("/"), recursive))
        if req.file:
            name, path = req.file.split(":", 1)
            repo = self._at(table[name], req.revision) if name in table else None
            if name in table and repo is None:
                return self._revision_not_found(h)
            if repo and path in repo["files"]:
                return self._file(h, repo, req.file, path, body)
            return self._json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        return self._json(h, 404, {"error": "Not found"})

    def _revision_not_found(self, h: BaseHTTPRequestHandler) -> None:
        self._json(h, 404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})

    @staticmethod
    def _tree(repo: dict, under: str, recursive: bool) -> list[dict]:
        prefix = f"{under}/" if under else ""
        entries, folders = [], set()
        for name, p in repo["files"].items():
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "path": name, "size": p.stat().st_size,
                                "oid": hashlib.sha1(p.read_bytes()).hexdigest()})
        return [{"type": "directory", "path": f, "oid": "0" * 40} for f in sorted(folders)] + entries

    def _file(self, h: BaseHTTPRequestHandler, repo: dict, key: str, path: str, body: bool) -> None:
        data = repo["files"][path].read_bytes()
        start, status = 0, 200
        m = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if m and int(m[1]) < len(data):
            start, status = int(m[1]), 206
        h.send_response(status)
        h.send_header("ETag", f'"{repo["sha256"][path]}"')
        h.send_header("X-Repo-Commit", repo["commit"])
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        with self.lock:
            cut = self.drop_once.pop(key, None) if body else None
        if cut is not None:
            h.send_header("Connection", "close")
        h.end_headers()
        if not body:
            return
        if cut is None:
            h.wfile.write(data[start:])
            return
        # The promised length never arrives: part of the file, then the end of the connection.
        h.wfile.write(data[start:start + cut])
        h.wfile.flush()
        h.connection.shutdown(socket.SHUT_WR)
        h.close_connection = True

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, payload, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
