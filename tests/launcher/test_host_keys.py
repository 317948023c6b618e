"""A node back at another address: its address and host keys come from the Compute Engine API
(instances.get, instances.getGuestAttributes under hostkeys/), served by the documented fake."""

from __future__ import annotations

from launcher.cluster.host_keys import find_moved, published_host_keys
from launcher.cluster.restart_vms import instances_client
from launcher.core.types import Node
from tests.launcher.fake_compute import FakeCompute, FakeInstance

P, Z = "proj-1", "us-central1-a"
ED = "AAAAC3NzaC1lZDI1NTE5AAAAIBx0dGVzdGtleXRlc3RrZXl0ZXN0a2V5dGVzdGtleQ"


def test_a_node_at_a_new_address_gets_it_and_the_keys_its_guest_environment_published():
    inst = FakeInstance("dev-1", "10.0.0.9", host_keys={"ssh-ed25519": ED, "ecdsa-sha2-nistp256": "AAAAE2Vj"})
    with FakeCompute({(P, Z): [inst]}) as api:
        node = Node(rank=1, host="10.0.0.3", address="10.0.0.3", name="dev-1")
        moved = find_moved(instances_client(api.endpoint), P, Z, node)
    assert moved is not None and (moved.node.host, moved.node.address, moved.node.rank) == ("10.0.0.9", "10.0.0.9", 1)
    assert sorted(moved.known_hosts_lines()) == [
        "10.0.0.9 ecdsa-sha2-nistp256 AAAAE2Vj",
        f"10.0.0.9 ssh-ed25519 {ED}",
    ]
    assert moved.known_hosts_lines(2222)[0].startswith("[10.0.0.9]:2222 ")
    assert [q["method"] for q in api.requests] == ["get", "getGuestAttributes"]


def test_an_unchanged_address_asks_for_no_keys():
    inst = FakeInstance("dev-1", "10.0.0.3", host_keys={"ssh-ed25519": ED})
    with FakeCompute({(P, Z): [inst]}) as api:
        node = Node(rank=1, host="10.0.0.3", address="10.0.0.3", name="dev-1")
        assert find_moved(instances_client(api.endpoint), P, Z, node) is None
        assert find_moved(instances_client(api.endpoint), P, Z, Node(rank=0, host="h", address="h")) is None
    assert [q["method"] for q in api.requests] == ["get"]


def test_an_external_host_follows_the_new_external_ip():
    inst = FakeInstance("dev-0", "10.0.0.2", external_ip="203.0.113.7", host_keys={"ssh-ed25519": ED})
    with FakeCompute({(P, Z): [inst]}) as api:
        node = Node(rank=0, host="203.0.113.5", address="10.0.0.2", name="dev-0")
        moved = find_moved(instances_client(api.endpoint), P, Z, node)
    assert moved is not None and (moved.node.host, moved.node.address) == ("203.0.113.7", "10.0.0.2")


def test_a_moved_node_without_published_keys_gets_none_never_the_offered_one():
    inst = FakeInstance("dev-1", "10.0.0.9")
    with FakeCompute({(P, Z): [inst]}) as api:
        client = instances_client(api.endpoint)
        assert published_host_keys(client, P, Z, "dev-1") == []
        moved = find_moved(client, P, Z, Node(rank=1, host="10.0.0.3", address="10.0.0.3", name="dev-1"))
    assert moved is not None and moved.host_keys == () and moved.known_hosts_lines() == []


def test_follow_moved_reaches_a_moved_node_at_its_new_address_with_its_published_key_only(tmp_path):
    from launcher.cluster.host_keys import follow_moved
    from launcher.core.types import Cluster

    nodes = tuple(Node(rank=i, host=f"10.0.0.{i + 2}", address=f"10.0.0.{i + 2}", name=f"dev-{i}") for i in range(3))
    cluster = Cluster("dev", nodes, zone=Z, project=P)
    api_nodes = [
        FakeInstance("dev-0", "10.0.0.2"),
        FakeInstance("dev-1", "10.0.0.7", host_keys={"ssh-ed25519": ED}),  # moved, published its key
        FakeInstance("dev-2", "10.0.0.8"),  # moved, published nothing: not trusted
    ]
    known = tmp_path / "known_hosts"
    known.write_text("10.0.0.2 ssh-ed25519 AAAAold\n")
    with FakeCompute({(P, Z): api_nodes}) as api:
        after = follow_moved(instances_client(api.endpoint), cluster, [1, 2], known)
    assert [n.host for n in after.nodes] == ["10.0.0.2", "10.0.0.7", "10.0.0.4"]
    assert after.nodes[1].rank == 1 and after.nodes[1].name == "dev-1"
    assert known.read_text() == f"10.0.0.2 ssh-ed25519 AAAAold\n10.0.0.7 ssh-ed25519 {ED}\n"
    # Node 0 was not asked about: only the unreachable ones are.
    assert {q["instance"] for q in api.requests} == {"dev-1", "dev-2"}
