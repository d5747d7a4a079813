"""A stand-in for the Kubernetes API server's RayJob endpoints (no cluster here), on loopback.

The real `kubernetes` client talks to it over HTTP (`CustomObjectsApi`, or a kubeconfig
pointing at `FakeKubeAPI.url`), so request paths, bodies and error statuses are the client's
own. It does what the API server and the KubeRay operator do to a RayJob, as far as the
submitting step can tell:

- POST validates the body against the KubeRay schema subset (422, as the API server's
  validation would) and answers 409 for an existing name;
- every GET moves the job one entry along `script` (a list of `.status` dicts, what the
  operator would write over time) and calls `on_status(name, status)` first, which is where a
  test plays the Ray job's side (writing progress.json or the merged model);
- DELETE removes it; GET of a missing name answers 404.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mempo.orchestration.rayjob_manifest import SCHEMA_PATH

_PATH = re.compile(r"^/apis/ray\.io/v1/namespaces/(?P<ns>[^/]+)/rayjobs(?:/(?P<name>[^/?]+))?")


class FakeKubeAPI:
    """Loopback HTTP server with the RayJob subset of the Kubernetes API (see module docstring)."""

    def __init__(self, script: list[dict[str, Any]],
                 on_status: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        import jsonschema

        self.script = list(script)
        self.on_status = on_status
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.position: dict[tuple[str, str], int] = {}
        self.held: set[tuple[str, str]] = set()
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []
        self._validator = jsonschema.Draft7Validator(json.loads(Path(SCHEMA_PATH).read_text()))
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self) -> tuple[str, str | None] | None:
                m = _PATH.match(self.path)
                if not m:
                    self._send(404, _status(404, "NotFound", f"no route {self.path}"))
                    return None
                return m["ns"], m["name"]

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                route = self._route()
                if route is None:
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(("POST", self.path))
                errors = list(fake._validator.iter_errors(body))
                if errors:
                    self._send(422, _status(422, "Invalid", errors[0].message))
                    return
                key = (route[0], body["metadata"]["name"])
                with fake._lock:
                    if key in fake.objects:
                        self._send(409, _status(409, "AlreadyExists", f"rayjobs.ray.io \"{key[1]}\" already exists"))
                        return
                    body.setdefault("status", {})
                    fake.objects[key] = body
                    fake.position[key] = -1
                    fake.created.append(json.loads(json.dumps(body)))
                self._send(201, body)

            def do_GET(self) -> None:  # noqa: N802
                route = self._route()
                if route is None:
                    return
                fake.requests.append(("GET", self.path))
                key = (route[0], route[1] or "")
                with fake._lock:
                    obj = fake.objects.get(key)
                    if obj is None:
                        self._send(404, _status(404, "NotFound", f"rayjobs.ray.io \"{key[1]}\" not found"))
                        return
                    if key in fake.held:  # a seeded job shows its own status once
                        fake.held.discard(key)
                        self._send(200, obj)
                        return
                    pos = min(fake.position[key] + 1, len(fake.script) - 1)
                    fake.position[key] = pos
                    if fake.script:
                        status = dict(fake.script[pos])
                        if fake.on_status:
                            fake.on_status(key[1], status)
                        obj["status"] = status
                    self._send(200, obj)

            def do_DELETE(self) -> None:  # noqa: N802
                route = self._route()
                if route is None:
                    return
                fake.requests.append(("DELETE", self.path))
                key = (route[0], route[1] or "")
                with fake._lock:
                    if fake.objects.pop(key, None) is None:
                        self._send(404, _status(404, "NotFound", f"rayjobs.ray.io \"{key[1]}\" not found"))
                        return
                self._send(200, _status(200, "Success", "deleted"))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def put(self, obj: dict[str, Any], status: dict[str, Any] | None = None) -> None:
        """Seed an existing RayJob (what a previous attempt of the step left)."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[key] = {**obj, "status": dict(status or {})}
        self.position[key] = -1
        self.held.add(key)

    def client(self) -> Any:
        """The real `CustomObjectsApi`, pointed at this server."""
        from kubernetes import client

        cfg = client.Configuration(host=self.url)
        return client.CustomObjectsApi(client.ApiClient(cfg))

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig file naming this server (for code that calls `kubernetes_api()`)."""
        import yaml

        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "mempo"}}],
        }))
        return path

    def __enter__(self) -> FakeKubeAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure" if code >= 400 else "Success",
            "code": code, "reason": reason, "message": message}
