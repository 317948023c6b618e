"""A compact placement policy: one COLLOCATED group placement for the whole fleet."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_gcp as gcp

__all__ = ["PlacementPolicyArgs", "PlacementPolicy"]


@dataclass(frozen=True)
class PlacementPolicyArgs:
    cluster: str
    project: str
    region: str
    nodes: int
    max_distance: int | None = None


class PlacementPolicy(pulumi.ComponentResource):
    """`self_link` is attached to every instance (Instance.resource_policies: one string in
    pulumi-gcp 10); instances depend on `policy`."""

    def __init__(self, name: str, args: PlacementPolicyArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gpufleet:infra:PlacementPolicy", name, None, opts)
        # "If compute instances are created with a COLLOCATED policy, then exactly `vm_count`
        # instances must be created at the same time with the resource policy attached"
        # (pulumi-gcp 10.2.0 ResourcePolicyGroupPlacementPolicyArgs docstring), so vm_count = nodes.
        policy_name = f"{args.cluster}-placement"
        self.policy = gcp.compute.ResourcePolicy(
            policy_name,
            gcp.compute.ResourcePolicyArgs(
                name=policy_name,
                project=args.project,
                region=args.region,
                group_placement_policy=gcp.compute.ResourcePolicyGroupPlacementPolicyArgs(
                    collocation="COLLOCATED",
                    vm_count=args.nodes,
                    max_distance=args.max_distance,
                ),
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
        # Instances take the policy by path (a plain string costs Pulumi less than an Output
        # input on each of 128 nodes; bench/bench_infra.py) and depend on `self.policy`.
        self.self_link = f"projects/{args.project}/regions/{args.region}/resourcePolicies/{policy_name}"
        self.register_outputs({"selfLink": self.policy.self_link})
