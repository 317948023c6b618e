"""The nodes' identity and storage: a least-privilege service account and the checkpoint bucket."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

__all__ = [
    "NODE_ROLES",
    "BUCKET_ROLE",
    "service_account_id",
    "service_account_email",
    "NodeIdentityArgs",
    "NodeIdentity",
]

# What a node needs on the project and nothing more: write its logs and metrics. It reads Artifact
# Registry only in the cluster's own repositories, granted on each (infra/registries.py); Google's
# GPUDirect images live in Google's public project gce-ai-infra, which needs no grant here.
NODE_ROLES = (
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
)
# Read, write and delete objects in the one bucket (checkpoints are overwritten and pruned), no
# bucket administration (https://cloud.google.com/storage/docs/access-control/iam-roles).
BUCKET_ROLE = "roles/storage.objectUser"


def service_account_id(cluster: str) -> str:
    """The node service account's ID: `<cluster>-nodes`, one per cluster within IAM's limit.

    An account ID is unique within a project, 6-30 characters, [a-z]([-a-z0-9]*[a-z0-9])
    (pulumi-gcp AccountArgs.account_id; changing it replaces the account). A cluster name longer
    than 24 characters is cut to 17 and a hash of the whole name appended, so two clusters that
    share a prefix get two accounts; the hash ends the ID, so it cannot equal a short name's.
    """
    if len(cluster) <= 24:
        return f"{cluster}-nodes"
    digest = hashlib.sha256(cluster.encode()).hexdigest()[:6]
    return f"{cluster[:17].rstrip('-')}-nodes-{digest}"


def service_account_email(account_id: str, project: str) -> str:
    """A created account's email, fixed by its ID and project: ID@PROJECT.iam.gserviceaccount.com,
    and for a domain-scoped project "example.com:proj", ID@proj.example.com.iam.gserviceaccount.com
    (https://cloud.google.com/iam/docs/service-account-overview)."""
    domain, _, project_name = project.rpartition(":")
    host = f"{project_name}.{domain}" if domain else project_name
    return f"{account_id}@{host}.iam.gserviceaccount.com"


@dataclass(frozen=True)
class NodeIdentityArgs:
    cluster: str
    project: str
    region: str
    service_account: str | None
    """Existing email to use as is; None = create one with NODE_ROLES."""
    checkpoint_bucket: str | None
    labels: dict[str, str]


class NodeIdentity(pulumi.ComponentResource):
    """`email` is the nodes' service account; `bucket_name` the checkpoint bucket (None if not
    asked); `grants` what the nodes must be created after (the account and its role bindings)."""

    def __init__(self, name: str, args: NodeIdentityArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:NodeIdentity", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.grants: list[pulumi.Resource] = []
        if args.service_account is None:
            account_id = service_account_id(args.cluster)
            account = gcp.serviceaccount.Account(
                f"{args.cluster}-nodes",
                gcp.serviceaccount.AccountArgs(
                    account_id=account_id,
                    project=args.project,
                    display_name=f"gpufleet {args.cluster} nodes",
                ),
                opts=child,
            )
            # The email is fixed by the account ID and project (https://cloud.google.com/iam/docs/
            # service-account-overview: ID@PROJECT_ID.iam.gserviceaccount.com; a domain-scoped
            # project "example.com:proj" gives ID@proj.example.com.iam.gserviceaccount.com).
            # Instances take it as a plain string (cheaper for Pulumi than 128 Output inputs;
            # bench/bench_infra.py) and are ordered after the account by `grants`.
            domain, _, project_name = args.project.rpartition(":")
            host = f"{project_name}.{domain}" if domain else project_name
            self.email: pulumi.Input[str] = f"{account_id}@{host}.iam.gserviceaccount.com"
            self.grants.append(account)
            member = f"serviceAccount:{self.email}"
            for role in NODE_ROLES:
                self.grants.append(
                    gcp.projects.IAMMember(
                        f"{args.cluster}-nodes-{role.split('/')[1].replace('.', '-')}",
                        gcp.projects.IAMMemberArgs(project=args.project, role=role, member=member),
                        opts=pulumi.ResourceOptions(parent=self, depends_on=[account]),
                    )
                )
        else:
            self.email = args.service_account
            member = f"serviceAccount:{args.service_account}"
        self.member = member

        self.bucket_name: pulumi.Output[str] | None = None
        if args.checkpoint_bucket is not None:
            bucket = gcp.storage.Bucket(
                args.checkpoint_bucket,
                gcp.storage.BucketArgs(
                    name=args.checkpoint_bucket,
                    project=args.project,
                    location=args.region.upper(),  # same region as the nodes: no egress charges
                    uniform_bucket_level_access=True,
                    public_access_prevention="enforced",
                    labels=args.labels,
                ),
                opts=child,
            )
            self.grants.append(
                gcp.storage.BucketIAMMember(
                    f"{args.cluster}-nodes-checkpoints",
                    gcp.storage.BucketIAMMemberArgs(bucket=bucket.name, role=BUCKET_ROLE, member=member),
                    opts=child,
                )
            )
            self.bucket_name = bucket.name
        self.register_outputs({"email": self.email, "bucket": self.bucket_name})
