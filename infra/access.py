"""Who may log in: each `gpufleet:users` member gets what an SSH login through IAP and OS Login
needs on this cluster's VMs, and nothing on the project (least privilege).

The stack turns OS Login on (`enable-oslogin` metadata, infra/nodes.py), so a login is decided by
IAM (https://cloud.google.com/compute/docs/oslogin/set-up-oslogin, "Grant OS Login IAM roles"):

- `roles/compute.osLogin` on each instance: log in as yourself, without sudo. An admin who needs
  sudo on the nodes needs `roles/compute.osAdminLogin` instead, granted by hand
  (docs/fleet.md, "Who may log in"); the stack never grants root.
- `roles/iam.serviceAccountUser` on the VMs' service accounts: OS Login requires it of every user
  of a VM that runs as a service account (same page), as the nodes and the controller do.
- `roles/iap.tunnelResourceAccessor` on each instance: the nodes have no external address by
  default and admit SSH only from IAP's range, so a laptop gets in through an IAP TCP tunnel
  (https://cloud.google.com/iap/docs/using-tcp-forwarding, "Grant permissions to use IAP TCP
  forwarding": the role at instance level).

Every binding is on an instance or a service account, never the project, so a member of one
cluster gains nothing on another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

__all__ = ["LOGIN_ROLE", "ADMIN_LOGIN_ROLE", "ACCOUNT_USER_ROLE", "TUNNEL_ROLE", "LoginAccessArgs", "LoginAccess"]

LOGIN_ROLE = "roles/compute.osLogin"
ADMIN_LOGIN_ROLE = "roles/compute.osAdminLogin"  # documented, never granted here
ACCOUNT_USER_ROLE = "roles/iam.serviceAccountUser"
TUNNEL_ROLE = "roles/iap.tunnelResourceAccessor"


def _tag(member: str) -> str:
    """A short stable name part for a member: resource names survive reordering the list."""
    return hashlib.sha256(member.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class LoginAccessArgs:
    cluster: str
    project: str
    zone: str
    members: Sequence[str]
    """IAM members (`user:EMAIL`, `group:EMAIL`, ...), checked by infra/config.py."""
    instances: Sequence[tuple[str, pulumi.Resource]]
    """(instance name, the Instance resource): every node and the controller."""
    service_accounts: Sequence[str]
    """Emails of the service accounts those instances run as."""


class LoginAccess(pulumi.ComponentResource):
    """Per member: the login and tunnel roles on each instance, the account-user role on each of
    their service accounts (`bindings`)."""

    def __init__(self, name: str, args: LoginAccessArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:LoginAccess", name, None, opts)
        self.bindings: list[pulumi.Resource] = []
        # An account's binding after the instances that run as it: by then the account exists.
        child = pulumi.ResourceOptions(parent=self, depends_on=[instance for _, instance in args.instances])
        for member in args.members:
            tag = _tag(member)
            for instance_name, instance in args.instances:
                after = pulumi.ResourceOptions(parent=self, depends_on=[instance])
                self.bindings.append(
                    gcp.compute.InstanceIAMMember(
                        f"{instance_name}-oslogin-{tag}",
                        gcp.compute.InstanceIAMMemberArgs(
                            project=args.project,
                            zone=args.zone,
                            instance_name=instance_name,
                            role=LOGIN_ROLE,
                            member=member,
                        ),
                        opts=after,
                    )
                )
                self.bindings.append(
                    gcp.iap.TunnelInstanceIAMMember(
                        f"{instance_name}-iap-{tag}",
                        gcp.iap.TunnelInstanceIAMMemberArgs(
                            project=args.project,
                            zone=args.zone,
                            instance=instance_name,
                            role=TUNNEL_ROLE,
                            member=member,
                        ),
                        opts=after,
                    )
                )
            for email in dict.fromkeys(args.service_accounts):
                self.bindings.append(
                    gcp.serviceaccount.IAMMember(
                        f"{email.split('@', 1)[0]}-user-{tag}",
                        gcp.serviceaccount.IAMMemberArgs(
                            service_account_id=f"projects/{args.project}/serviceAccounts/{email}",
                            role=ACCOUNT_USER_ROLE,
                            member=member,
                        ),
                        opts=child,
                    )
                )
        self.register_outputs({"members": list(args.members)})
