"""The cluster's Artifact Registry repositories: a docker repository for the jobs' container images,
and (unless `gpufleet:packageIndex false`) a remote repository that caches PyPI in the nodes'
region, where the nodes build their Python environments from.

The nodes' service account reads both and nothing else of Artifact Registry: one
`roles/artifactregistry.reader` binding per repository (repository-level IAM,
https://cloud.google.com/artifact-registry/docs/access-control#grant-repo), never on the project.
Google's GPUDirect images and apt packages (project gce-ai-infra) need no grant here: that is
Google's public project, not this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

__all__ = [
    "READER_ROLE",
    "API",
    "STORAGE_USD_PER_GB_MONTH",
    "FREE_GB",
    "PRICING_SOURCE",
    "docker_repository_id",
    "python_repository_id",
    "docker_host",
    "docker_repository_url",
    "package_index_url",
    "RegistriesArgs",
    "Registries",
]

READER_ROLE = "roles/artifactregistry.reader"
# The service the repositories need; enabled by the program, left enabled by `pulumi destroy`.
API = "artifactregistry.googleapis.com"

# https://cloud.google.com/artifact-registry/pricing ("Storage": up to 0.5 GB free, over 0.5 GB
# $0.10 per GB per month, the same for standard and remote repositories; the free tier is per
# billing account, not per project; "Data moves within the same location": free, and the nodes are
# in the repositories' region). A remote repository bills the packages it has cached.
STORAGE_USD_PER_GB_MONTH = 0.10
FREE_GB = 0.5
PRICING_SOURCE = "https://cloud.google.com/artifact-registry/pricing"


def docker_repository_id(cluster: str) -> str:
    """`<cluster>-images` (repository IDs: lowercase letters, digits and hyphens, up to 63)."""
    return f"{cluster}-images"


def python_repository_id(cluster: str) -> str:
    """`<cluster>-pypi`."""
    return f"{cluster}-pypi"


def _project_path(project: str) -> str:
    # A domain-scoped project "example.com:proj" is "example.com/proj" in a pkg.dev path
    # (https://cloud.google.com/artifact-registry/docs/docker/names#domain).
    return project.replace(":", "/")


def docker_host(region: str) -> str:
    """The docker registry host of a region's repositories (LOCATION-docker.pkg.dev)."""
    return f"{region}-docker.pkg.dev"


def docker_repository_url(cluster: str, project: str, region: str) -> str:
    """Where images are pushed and pulled: LOCATION-docker.pkg.dev/PROJECT/REPOSITORY
    (https://cloud.google.com/artifact-registry/docs/docker/names)."""
    return f"{docker_host(region)}/{_project_path(project)}/{docker_repository_id(cluster)}"


def package_index_url(cluster: str, project: str, region: str) -> str:
    """pip's --index-url for the PyPI remote repository: https://LOCATION-python.pkg.dev/PROJECT/REPOSITORY/simple/
    (https://cloud.google.com/artifact-registry/docs/python/authentication)."""
    return f"https://{region}-python.pkg.dev/{_project_path(project)}/{python_repository_id(cluster)}/simple/"


@dataclass(frozen=True)
class RegistriesArgs:
    cluster: str
    project: str
    region: str
    labels: dict[str, str]
    package_index: bool
    """Declare the PyPI remote repository (gpufleet:packageIndex)."""
    reader: str
    """The nodes' service account, as an IAM member (`serviceAccount:EMAIL`)."""


class Registries(pulumi.ComponentResource):
    """`docker_url` and `package_index_url` (None without one) are plain strings, fixed by the
    repository IDs; `grants` the reader bindings the nodes must be created after."""

    def __init__(self, name: str, args: RegistriesArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:Registries", name, None, opts)
        api = gcp.projects.Service(
            f"{args.cluster}-artifactregistry-api",
            gcp.projects.ServiceArgs(project=args.project, service=API, disable_on_destroy=False),
            opts=pulumi.ResourceOptions(parent=self),
        )
        after_api = pulumi.ResourceOptions(parent=self, depends_on=[api])

        def repository(suffix: str, repository_id: str, fmt: str, description: str, **kw: object) -> tuple:
            name = f"{args.cluster}-{suffix}"
            return name, gcp.artifactregistry.Repository(
                name,
                gcp.artifactregistry.RepositoryArgs(
                    project=args.project,
                    location=args.region,
                    repository_id=repository_id,
                    format=fmt,
                    description=f"gpufleet {args.cluster}: {description}",
                    labels=args.labels,
                    **kw,
                ),
                opts=after_api,
            )

        repos = [
            repository(
                "images",
                docker_repository_id(args.cluster),
                "DOCKER",
                "the jobs' container images",
                mode="STANDARD_REPOSITORY",
            )
        ]
        self.docker_url = docker_repository_url(args.cluster, args.project, args.region)
        self.package_index_url: str | None = None
        if args.package_index:
            pypi = gcp.artifactregistry.RepositoryRemoteRepositoryConfigPythonRepositoryArgs(public_repository="PYPI")
            repos.append(
                repository(
                    "pypi",
                    python_repository_id(args.cluster),
                    "PYTHON",
                    "PyPI, cached in the nodes' region",
                    mode="REMOTE_REPOSITORY",
                    remote_repository_config=gcp.artifactregistry.RepositoryRemoteRepositoryConfigArgs(
                        description="PyPI", python_repository=pypi
                    ),
                )
            )
            self.package_index_url = package_index_url(args.cluster, args.project, args.region)
        self.grants: list[pulumi.Resource] = [
            gcp.artifactregistry.RepositoryIamMember(
                f"{name}-reader",
                gcp.artifactregistry.RepositoryIamMemberArgs(
                    project=args.project,
                    location=args.region,
                    repository=repo.repository_id,
                    role=READER_ROLE,
                    member=args.reader,
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )
            for name, repo in repos
        ]
        self.register_outputs({"docker": self.docker_url, "packageIndex": self.package_index_url})
