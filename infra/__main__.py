"""The gpufleet Pulumi program: stack config -> networks, placement, identity, nodes, controller -> outputs.

Pulumi runs this file as `__main__` (Pulumi.yaml `main: infra/`). It only wires: the config is
read once into a validated FleetSpec (infra/config.py) before any resource is declared, and the
outputs are the launcher's contract (gpufleet.contracts.stack_outputs).
"""

from __future__ import annotations

import os
import sys

# Run as a program, `infra/` is the script's directory, not a package; make `import infra.*`
# resolve from the repository root (the editable install does the same when it is present).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import pulumi  # noqa: E402

from gpufleet.contracts import boot_image_output, stack_outputs  # noqa: E402
from infra.access import LoginAccess, LoginAccessArgs  # noqa: E402
from infra.config import ConfigError, read_spec, spec_warnings  # noqa: E402
from infra.controller import ControllerVm, ControllerVmArgs, controller_name  # noqa: E402
from infra.identity import NodeIdentity, NodeIdentityArgs  # noqa: E402
from infra.networks import GpuNetworks, GpuNetworksArgs  # noqa: E402
from infra.nodes import NodePool, NodePoolArgs  # noqa: E402
from infra.placement import PlacementPolicy, PlacementPolicyArgs  # noqa: E402
from infra.registries import Registries, RegistriesArgs, docker_host  # noqa: E402
from infra.restart_grant import RestartGrant, RestartGrantArgs  # noqa: E402
from infra.startup import render_controller_script, render_startup_script  # noqa: E402


def main() -> None:
    try:
        spec = read_spec()
    except ConfigError as e:
        # RunError: Pulumi prints the message alone, without a Python traceback.
        raise pulumi.RunError(str(e)) from None
    for warning in spec_warnings(spec):
        pulumi.log.warn(warning)

    networks = GpuNetworks(
        f"{spec.cluster}-networks",
        GpuNetworksArgs(
            cluster=spec.cluster,
            project=spec.project,
            region=spec.region,
            zone=spec.zone,
            machine=spec.machine,
            ssh_source_ranges=spec.ssh_source_ranges,
            nat=not spec.external_ip,
        ),
    )
    placement = None
    if spec.placement == "compact":
        placement = PlacementPolicy(
            f"{spec.cluster}-placement",
            PlacementPolicyArgs(
                cluster=spec.cluster,
                project=spec.project,
                region=spec.region,
                nodes=spec.vm_count,
                max_distance=spec.max_distance,
            ),
        )
    identity = NodeIdentity(
        f"{spec.cluster}-identity",
        NodeIdentityArgs(
            cluster=spec.cluster,
            project=spec.project,
            region=spec.region,
            service_account=spec.service_account,
            checkpoint_bucket=spec.checkpoint_bucket,
            labels=spec.cluster_labels,
        ),
    )
    # The jobs' images and (unless turned off) PyPI cached in the region; the nodes read both.
    registries = Registries(
        f"{spec.cluster}-registries",
        RegistriesArgs(
            cluster=spec.cluster,
            project=spec.project,
            region=spec.region,
            labels=spec.cluster_labels,
            package_index=spec.package_index,
            reader=identity.member,
        ),
    )
    pool = NodePool(
        f"{spec.cluster}-nodes",
        NodePoolArgs(
            spec=spec,
            nic_targets=networks.nic_targets,
            service_account_email=identity.email,
            startup_script=render_startup_script(
                spec.machine,
                cluster=spec.cluster,
                image_os=spec.image_os,
                docker_registries=(docker_host(spec.region),),
            ),
            placement_policy=placement.self_link if placement else None,
            depends_on=[
                *networks.attach_after,
                *identity.grants,
                *registries.grants,
                *([placement.policy] if placement else []),
            ],
        ),
    )

    # --recover's restart of a stopped Spot node: start and get on these instances, nothing more.
    restart = RestartGrant(
        f"{spec.cluster}-restart",
        RestartGrantArgs(
            cluster=spec.cluster,
            project=spec.project,
            zone=spec.zone,
            member=f"serviceAccount:{identity.email}",
            instances=[(f"{spec.cluster}-{i}", inst) for i, inst in enumerate(pool.instances)],
        ),
    )

    # Detached jobs' controllers run here, off the GPU nodes; it restarts their stopped VMs.
    controller = None
    if spec.controller:
        controller = ControllerVm(
            f"{spec.cluster}-controller",
            ControllerVmArgs(
                cluster=spec.cluster,
                project=spec.project,
                zone=spec.zone,
                subnetwork=networks.nic_targets[0][0],
                external_ip=spec.external_ip,
                labels=dict(spec.labels),
                network_tag=spec.cluster,
                startup_script=render_controller_script(cluster=spec.cluster, source=spec.controller_source),
                restart_role=restart.role_name,
                nodes=[(f"{spec.cluster}-{i}", inst) for i, inst in enumerate(pool.instances)],
                depends_on=networks.attach_after,
                grants_after=[restart.role],
            ),
        )

    # gpufleet:users: who may log in (OS Login) through IAP, on these VMs alone.
    if spec.users:
        instances = [(f"{spec.cluster}-{i}", inst) for i, inst in enumerate(pool.instances)]
        accounts = [identity.email]
        if controller is not None:
            instances.append((controller_name(spec.cluster), controller.instance))
            accounts.append(controller.email)
        LoginAccess(
            f"{spec.cluster}-login",
            LoginAccessArgs(
                cluster=spec.cluster,
                project=spec.project,
                zone=spec.zone,
                members=spec.users,
                instances=instances,
                service_accounts=accounts,
            ),
            opts=pulumi.ResourceOptions(depends_on=identity.grants),
        )

    outputs = stack_outputs(
        cluster=spec.cluster,
        project=spec.project,
        zone=spec.zone,
        machine_type=spec.machine_type,
        nodes=pool.nodes,
        spares=spec.spares,
        placement_policy=placement.policy.name if placement else None,
        networks=networks.summary,
        checkpoint_bucket=identity.bucket_name,
        controller=controller.output if controller else None,
        package_index=registries.package_index_url,
        image=spec.container_image,
        image_repository=registries.docker_url,
        boot_image=boot_image_output(spec.image),
    )
    for key, value in outputs.items():
        pulumi.export(key, value)


main()
