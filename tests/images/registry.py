"""A minimal OCI distribution registry serving one OCI image layout over plain HTTP on 127.0.0.1.

Enough of the distribution API for a client's pull (``GET /v2/``, manifests by tag or digest,
blobs by digest), so registry references are tested for real without a registry on the network.
It serves only files named by a digest under the layout's ``blobs/sha256``.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from pathlib import Path
from typing import Any

__all__ = ["serve"]

_HEX = re.compile(r"^sha256:([0-9a-f]{64})$")


def serve(layout: Path) -> http.server.ThreadingHTTPServer:
    """Start serving ``layout`` in a daemon thread; the caller calls ``shutdown()`` and ``server_close()``."""
    index = json.loads((layout / "index.json").read_text())
    tags: dict[str, dict[str, Any]] = {
        m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"] if m.get("annotations")
    }
    blobs = layout / "blobs" / "sha256"

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes = b"{}", ctype: str = "application/json", digest: str = "") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if digest:
                self.send_header("Docker-Content-Digest", digest)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/v2/", "/v2"):
                return self._send(200)
            m = re.match(r"^/v2/(.+)/(manifests|blobs)/([^/]+)$", path)
            if not m:
                return self._send(404)
            kind, ref = m.group(2), m.group(3)
            desc = tags.get(ref) if kind == "manifests" else None
            digest = desc["digest"] if desc else ref
            hexd = _HEX.match(digest)
            if hexd is None or not (blobs / hexd.group(1)).is_file():
                return self._send(404, b'{"errors": [{"code": "NOT_FOUND"}]}')
            body = (blobs / hexd.group(1)).read_bytes()
            if kind == "manifests":
                ctype = desc["mediaType"] if desc else json.loads(body).get("mediaType", "")
                return self._send(200, body, ctype or "application/vnd.oci.image.manifest.v1+json", digest)
            return self._send(200, body, "application/octet-stream", digest)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="test-registry", daemon=True).start()
    return server
