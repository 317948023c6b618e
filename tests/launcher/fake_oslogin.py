"""A local stand-in for the OS Login API (v1), for the launcher's OS Login tests.

It serves, as documented:
- `users.getLoginProfile`: GET /v1/users/{user}/loginProfile?projectId=P, a LoginProfile
  `{"name": "users/{user}", "posixAccounts": [...], "sshPublicKeys": {fingerprint: SshPublicKey}}`
  (https://cloud.google.com/compute/docs/oslogin/rest/v1/users/getLoginProfile,
  https://cloud.google.com/compute/docs/oslogin/rest/v1/LoginProfile); a PosixAccount is
  `{"primary", "username", "uid", "gid", "homeDirectory", "operatingSystemType", "accountId", "name"}`
  (https://cloud.google.com/compute/docs/oslogin/rest/Shared.Types/PosixAccount), an SshPublicKey
  `{"key", "fingerprint", "name"}` (https://cloud.google.com/compute/docs/oslogin/rest/v1/users.sshPublicKeys);
- `users.importSshPublicKey`: POST /v1/users/{user}:importSshPublicKey?projectId=P with an
  SshPublicKey body, answered `{"loginProfile": LoginProfile}`
  (https://cloud.google.com/compute/docs/oslogin/rest/v1/users/importSshPublicKey).
An unknown user answers 404 in Google's JSON error format (`{"error": {"code", "message",
"status"}}`, https://cloud.google.com/apis/design/errors); `disabled=True` answers every call as
an API not enabled in the project does (403 PERMISSION_DENIED, reason SERVICE_DISABLED).
Every request is in `requests` (`method`, `path`, `query`, `body`)."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

__all__ = ["FakeOsLogin", "OsLoginUser", "fingerprint"]


def fingerprint(key: str) -> str:
    """OS Login's fingerprint of a key: the SHA-256 of its blob, in hex."""
    return hashlib.sha256(base64.b64decode(key.split()[1])).hexdigest()


@dataclass
class OsLoginUser:
    email: str
    username: str
    keys: list[str] = field(default_factory=list)  # "TYPE BASE64 [COMMENT]"
    posix: bool = True  # False: no POSIX account in the project (no roles/compute.osLogin)

    def profile(self) -> dict:
        accounts = []
        if self.posix:
            accounts = [
                {
                    "primary": True,
                    "username": self.username,
                    "uid": "1234567",
                    "gid": "1234567",
                    "homeDirectory": f"/home/{self.username}",
                    "operatingSystemType": "LINUX",
                    "accountId": "p",
                    "name": f"users/{self.email}/projects/p",
                }
            ]
        keys = {
            fingerprint(k): {
                "key": k,
                "fingerprint": fingerprint(k),
                "name": f"users/{self.email}/sshPublicKeys/{fingerprint(k)}",
            }
            for k in self.keys
        }
        return {"name": f"users/{self.email}", "posixAccounts": accounts, "sshPublicKeys": keys}


class FakeOsLogin:
    """A threaded HTTP server; use as a context manager. `endpoint` is the API's base URL."""

    def __init__(self, users: list[OsLoginUser], disabled: bool = False):
        self.users = {u.email: u for u in users}
        self.disabled = disabled
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, status: str, message: str, reason: str | None = None) -> None:
                err: dict = {"code": code, "message": message, "status": status}
                if reason:
                    err["details"] = [
                        {
                            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                            "reason": reason,
                            "domain": "googleapis.com",
                        }
                    ]
                self._answer(code, {"error": err})

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append(
                    {"method": method, "path": unquote(url.path), "query": parse_qs(url.query), "body": body}
                )
                if fake.disabled:
                    return self._error(
                        403,
                        "PERMISSION_DENIED",
                        "Cloud OS Login API has not been used in project p before or it is disabled.",
                        "SERVICE_DISABLED",
                    )
                path = unquote(url.path)
                if method == "GET" and path.startswith("/v1/users/") and path.endswith("/loginProfile"):
                    email, op = path[len("/v1/users/") : -len("/loginProfile")], "get"
                elif method == "POST" and path.startswith("/v1/users/") and path.endswith(":importSshPublicKey"):
                    email, op = path[len("/v1/users/") : -len(":importSshPublicKey")], "import"
                else:
                    return self._error(404, "NOT_FOUND", f"unknown path {path}")
                user = fake.users.get(email)
                if user is None:
                    return self._error(404, "NOT_FOUND", f"Requested entity was not found: users/{email}")
                if op == "get":
                    return self._answer(200, user.profile())
                user.keys.append(body["key"])
                return self._answer(200, {"loginProfile": user.profile()})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeOsLogin:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
