"""gpufleet's Pulumi program (`__main__.py`, run by `pulumi up` through Pulumi.yaml `main: infra/`).

Importing this package imports nothing: pulumi is imported only by the program and its component
modules (networks, placement, nodes, identity, mocks, preview). `infra.config`, `infra.layout` and
`infra.startup` are pulumi-free. What the program promises the launcher (stack outputs, labels,
the ready marker) is in `gpufleet.contracts`, which the launcher reads too.
"""
