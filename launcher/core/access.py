"""Why a node would not let us in, from what ssh (and the IAP tunnel under it) printed: one line
naming the missing permission, the firewall rule or the key to register, or None when the
output says none of these. Pure: it reads lines.

IAP's TCP forwarding answers a tunnel it cannot open with an error code that `gcloud compute
start-iap-tunnel` prints (https://cloud.google.com/iap/docs/troubleshooting-access, "IAP for TCP
forwarding"): 4033 'not authorized' (the account lacks iap.tunnelInstances.accessViaIAP, in
roles/iap.tunnelResourceAccessor), 4003 'failed to connect to backend' (no firewall rule lets IAP's
range 35.235.240.0/20 reach port 22, https://cloud.google.com/iap/docs/using-tcp-forwarding);
an API that is not enabled answers SERVICE_DISABLED / "has not been used in project"."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["diagnose", "IAP_RANGE"]

IAP_RANGE = "35.235.240.0/20"

_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"(?s)(?=.*(iap\.googleapis\.com|Identity-Aware Proxy API))"
            r"(?=.*(has not been used|is disabled|SERVICE_DISABLED))"
        ),
        "IAP is not enabled in the nodes' project: `gcloud services enable iap.googleapis.com`, or --no-iap "
        "where this machine reaches their internal addresses",
    ),
    (
        re.compile(r"4033|not authorized", re.I),
        "IAP refused the tunnel: your account lacks iap.tunnelInstances.accessViaIAP on the nodes; an admin "
        "grants roles/iap.tunnelResourceAccessor (`gcloud projects add-iam-policy-binding PROJECT "
        "--member=user:YOU --role=roles/iap.tunnelResourceAccessor`)",
    ),
    (
        re.compile(r"4003|failed to connect to backend", re.I),
        f"IAP cannot reach port 22 on the nodes: add a firewall rule allowing tcp:22 from IAP's range "
        f"{IAP_RANGE} to them (the stack's default gpufleet:sshSourceRanges)",
    ),
    (
        re.compile(r"Permission denied \(publickey"),
        "the nodes refused your key (Permission denied (publickey)): with OS Login, register it with "
        "`gcloud compute os-login ssh-keys add --key-file=KEY.pub` (or pass --register-key) and log in as your "
        "OS Login user (leave --ssh-user out); see docs/troubleshooting-ssh.md",
    ),
)


def diagnose(lines: Iterable[str]) -> str | None:
    """The one line for the first rule any of `lines` matches, else None."""
    text = "\n".join(lines)
    for pattern, line in _RULES:
        if pattern.search(text):
            return line
    return None
