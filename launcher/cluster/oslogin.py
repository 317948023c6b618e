"""OS Login: who this Google account is on the nodes, and whether they will take its key.

The stack's nodes turn OS Login on (metadata `enable-oslogin=TRUE`): sshd asks Google for the
account behind a key, and the account's POSIX user name is the one to log in as
(https://cloud.google.com/compute/docs/oslogin). So, unless --ssh-user names a user, the launcher
reads the account's login profile from the OS Login API:

- `users.getLoginProfile`: GET https://oslogin.googleapis.com/v1/users/ACCOUNT/loginProfile?projectId=P,
  a LoginProfile `{name, posixAccounts: [{username, uid, primary, ...}], sshPublicKeys: {FP: {key, fingerprint}}}`
  (https://cloud.google.com/compute/docs/oslogin/rest/v1/users/getLoginProfile);
- `users.importSshPublicKey` (--register-key): POST .../v1/users/ACCOUNT:importSshPublicKey?projectId=P
  with an SshPublicKey `{key}`, answered with `{loginProfile}`
  (https://cloud.google.com/compute/docs/oslogin/rest/v1/users/importSshPublicKey).

ACCOUNT is gcloud's (`gcloud config get-value account`): the account whose `gcloud compute
start-iap-tunnel` carries the connection and whose `gcloud compute os-login ssh-keys add` the
fix names. Errors come back as Google's JSON error (`{"error": {code, message, status}}`) and
become one line each: an account OS Login does not know, the API not enabled, no POSIX account
in the project (the roles/compute.osLogin grant), a key that is not registered."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.core.types import Cluster, SshConfig, UserError

__all__ = ["Login", "applies", "login_user", "account", "public_key", "DEFAULT_KEYS", "API"]

API = "https://oslogin.googleapis.com"
# The keys ssh offers by default (ssh(1), -i), and gcloud's own, in that order.
DEFAULT_KEYS = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa", "~/.ssh/google_compute_engine")
_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


@dataclass(frozen=True)
class Login:
    """Who to log in as; `added`: the public key --register-key just added to the profile."""

    user: str
    account: str
    added: Path | None = None


def applies(cluster: Cluster, ssh: SshConfig) -> bool:
    """Whether the user name is OS Login's: the nodes are Compute Engine instances by name (the
    stack's outputs, --label) and nothing names the user (--ssh-user, `User=`, `user@host`)."""
    if cluster.local or not cluster.nodes or ssh.user:
        return False
    if any(o.split("=", 1)[0].strip().lower() == "user" for o in ssh.options):
        return False
    return all(n.name and "@" not in n.host for n in cluster.nodes)


def account() -> str:
    """The Google account gcloud acts as (`gcloud config get-value account`)."""
    if shutil.which("gcloud") is None:
        raise UserError(
            "the nodes use OS Login and the user name comes from your Google account, which needs the gcloud "
            "CLI (https://cloud.google.com/sdk/docs/install); or pass --ssh-user"
        )
    try:
        proc = subprocess.run(["gcloud", "config", "get-value", "account"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UserError("`gcloud config get-value account` did not answer within 60 s; pass --ssh-user") from None
    name = proc.stdout.strip()
    if proc.returncode != 0 or not name or name == "(unset)":
        raise UserError("gcloud has no account: run `gcloud auth login` (or pass --ssh-user)")
    return name


def public_key(key: Path | None) -> tuple[Path, str]:
    """The public key ssh will offer: KEY.pub of --ssh-key, else of the first default key that
    exists; its `TYPE BASE64` part (what OS Login compares)."""
    candidates = [Path(key)] if key else [Path(k).expanduser() for k in DEFAULT_KEYS]
    for private in candidates:
        pub = private.with_name(private.name + ".pub")
        if pub.is_file():
            words = pub.read_text().split()
            if len(words) >= 2:
                return pub, f"{words[0]} {words[1]}"
            raise UserError(f"{pub} is not an OpenSSH public key (TYPE BASE64 [COMMENT])")
    if key:
        raise UserError(
            f"--ssh-key {key}: no {key}.pub beside it; OS Login needs the public key "
            f"(`ssh-keygen -y -f {key} > {key}.pub`)"
        )
    raise UserError(
        "no SSH key in ~/.ssh (id_ed25519, id_ecdsa, id_rsa, google_compute_engine): make one with "
        "`ssh-keygen -t ed25519` and pass --register-key, or pass --ssh-key FILE"
    )


def _session(endpoint: str | None) -> Any:
    """An HTTP session: google-auth's AuthorizedSession with the application-default credentials,
    or a plain one for a local endpoint (tests)."""
    import requests

    if endpoint:
        return requests.Session()
    import google.auth
    from google.auth import exceptions as gauth
    from google.auth.transport.requests import AuthorizedSession

    try:
        credentials, _ = google.auth.default(scopes=[_SCOPE])
    except gauth.GoogleAuthError:
        raise UserError(
            "no Google credentials to read your OS Login profile: run `gcloud auth application-default login`, "
            "or pass --ssh-user"
        ) from None
    return AuthorizedSession(credentials)


def _error(resp: Any, who: str, project: str | None) -> UserError:
    """One line for a Google API error answer."""
    try:
        err = resp.json().get("error", {})
    except ValueError:
        err = {}
    message = err.get("message") or resp.text.strip()[:200] or f"HTTP {resp.status_code}"
    if resp.status_code == 404:
        return UserError(
            f"OS Login knows no user {who} (`gcloud config get-value account`): sign in as the account that "
            "should reach the nodes (`gcloud auth login`), or pass --ssh-user"
        )
    if "SERVICE_DISABLED" in json.dumps(err) or "has not been used" in message or "is disabled" in message:
        return UserError(
            f"the OS Login API is not enabled in project {project}: `gcloud services enable oslogin.googleapis.com "
            f"--project {project}`, or pass --ssh-user"
        )
    return UserError(f"OS Login refused to read {who}'s profile in project {project}: {message}")


def _username(profile: dict[str, Any], who: str, project: str | None) -> str:
    accounts = [a for a in profile.get("posixAccounts") or [] if a.get("username")]
    if not accounts:
        raise UserError(
            f"{who} has no OS Login user in project {project}: an admin grants it with `gcloud projects "
            f"add-iam-policy-binding {project} --member=user:{who} --role=roles/compute.osLogin` "
            "(the stack's gpufleet:users does), or pass --ssh-user"
        )
    primary = [a for a in accounts if a.get("primary")]
    return (primary or accounts)[0]["username"]


def _registered(profile: dict[str, Any], key: str) -> bool:
    keys = (profile.get("sshPublicKeys") or {}).values()
    return any(" ".join(str(k.get("key", "")).split()[:2]) == key for k in keys)


def _call(method: Any, url: str, **kwargs: Any) -> Any:
    """One request to the OS Login API; a network failure or credentials that cannot be refreshed
    are one line naming the API and the way around it, not a traceback."""
    import requests
    from google.auth import exceptions as gauth

    try:
        return method(url, timeout=60, **kwargs)
    except (requests.RequestException, gauth.GoogleAuthError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(
            f"the OS Login API ({url.split('/v1/')[0]}) did not answer: {reason}; check this machine's network "
            "and `gcloud auth application-default login`, or pass --ssh-user"
        ) from None


def login_user(project: str | None, key: Path | None, register: bool = False, endpoint: str | None = None) -> Login:
    """This account's OS Login user name in `project`, once its public key is known to be in the
    profile (added first with `register`); one UserError line for each way it is not."""
    who = account()
    pub, key_text = public_key(key)
    session = _session(endpoint)
    base = (endpoint or API).rstrip("/")
    user = urllib.parse.quote(who, safe="@")
    query = f"?projectId={urllib.parse.quote(project)}" if project else ""
    resp = _call(session.get, f"{base}/v1/users/{user}/loginProfile{query}")
    if resp.status_code != 200:
        raise _error(resp, who, project)
    profile = resp.json()
    added = None
    if not _registered(profile, key_text):
        if not register:
            raise UserError(
                f"your key {pub} is not in {who}'s OS Login profile, so the nodes would answer Permission denied "
                f"(publickey): run `gcloud compute os-login ssh-keys add --key-file={pub}`, or pass --register-key"
            )
        resp = _call(session.post, f"{base}/v1/users/{user}:importSshPublicKey{query}", json={"key": key_text})
        if resp.status_code != 200:
            raise _error(resp, who, project)
        profile = resp.json().get("loginProfile") or profile
        added = pub
    return Login(_username(profile, who, project), who, added)
