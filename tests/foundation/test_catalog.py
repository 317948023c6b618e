"""The machine catalog: pure data, every listed type, cross-field facts that must hold."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpufleet import catalog
from gpufleet.catalog import NetStack, lookup

LISTED = """a2-highgpu-1g a2-highgpu-2g a2-highgpu-4g a2-highgpu-8g a2-megagpu-16g a2-ultragpu-1g
a2-ultragpu-2g a2-ultragpu-4g a2-ultragpu-8g a3-highgpu-1g a3-highgpu-2g a3-highgpu-4g a3-highgpu-8g
a3-edgegpu-8g a3-megagpu-8g a3-ultragpu-8g a4-highgpu-8g""".split()


def test_importing_the_catalog_imports_neither_pulumi_nor_torch():
    code = "import sys, gpufleet.catalog; print(sorted(m for m in ('pulumi', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_listed_machine_type_is_in_the_catalog():
    assert sorted(LISTED) == catalog.known_types()


def test_unknown_type_error_lists_the_known_ones():
    with pytest.raises(catalog.UnknownMachineType) as e:
        lookup("a3-mega")
    msg = str(e.value)
    assert "'a3-mega' is unknown" in msg and "a3-megagpu-8g" in msg and "a2-highgpu-1g" in msg


@pytest.mark.parametrize("name", LISTED)
def test_cross_field_facts(name):
    t = lookup(name)
    assert t.nics[0].role == "host"
    assert t.gpu_count == int(name.rsplit("-", 1)[1].rstrip("g"))
    assert t.gpu_network_gbps <= t.network_gbps
    if t.local_ssd_count and t.family != "a2":
        assert t.local_ssd_count == 2 * t.gpu_count or t.local_ssd_count == 4 * t.gpu_count
    if t.net_stack in (NetStack.TCPX, NetStack.TCPXO):
        assert t.gpu_mtu == 8244 and t.image_os in ("ubuntu", "cos")
        assert all(None not in t.interface_names(os_) for os_ in ("ubuntu", "cos"))
    assert t.gpu.peak_bf16_flops > 1e14


def test_a3_mega_has_one_host_nic_and_eight_gpu_nics():
    t = lookup("a3-megagpu-8g")
    assert (t.nic_count, t.gpu_network_count, t.gpu_count) == (9, 8, 8)
    assert t.net_stack is NetStack.TCPXO
    assert t.interface_names("cos") == tuple(f"eth{i}" for i in range(9))
    assert t.interface_names("ubuntu")[0] == "enp0s12"
    assert t.gpu_network_bytes_per_s == 200e9  # 8 GPU NICs x 200 Gbps = 200 GB/s


def test_a3_high_tcpx_layout_and_small_types_need_spot_or_flex():
    t = lookup("a3-highgpu-8g")
    assert (t.nic_count, t.gpu_network_count, t.net_stack) == (5, 4, NetStack.TCPX)
    assert t.interface_names("ubuntu")[1:] == ("enp6s0", "enp12s0", "enp134s0", "enp140s0")
    for small in ("a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g"):
        assert "standard" not in lookup(small).provisioning
        assert lookup(small).nic_count == 1


def test_rdma_types_have_two_gvnics_and_eight_cx7():
    for name in ("a3-ultragpu-8g", "a4-highgpu-8g"):
        t = lookup(name)
        assert [n.role for n in t.nics].count("rdma") == 8 and t.nic_count == 10
        assert t.gpu_mtu == 8896 and t.net_stack is NetStack.RDMA


def test_peak_flops_by_cuda_device_name():
    assert catalog.peak_flops_for_device("NVIDIA H100 80GB HBM3") == 989e12
    assert catalog.peak_flops_for_device("NVIDIA A100-SXM4-40GB") == 312e12
    assert catalog.peak_flops_for_device("NVIDIA B200") == 2.25e15
    assert catalog.peak_flops_for_device("NVIDIA H100 PCIe") == 756e12
    assert catalog.peak_flops_for_device("NVIDIA H100 NVL") == 835e12
    assert catalog.peak_flops_for_device("Tesla T4") is None


def test_interface_names_reject_an_unknown_os():
    with pytest.raises(ValueError, match="one of: ubuntu, cos"):
        lookup("a3-highgpu-8g").interface_names("windows")


# ---- facts infra reads from the catalog instead of testing family names -------------------


@pytest.mark.parametrize("name", LISTED)
def test_hyperdisk_and_reservation_bound_are_the_a3_ultra_and_a4_facts(name):
    t = lookup(name)
    rdma = t.family in ("a3-ultra", "a4")
    assert t.boot_disk_type == ("hyperdisk-balanced" if rdma else "pd-ssd")
    assert t.reservation_bound is rdma


@pytest.mark.parametrize("name", LISTED)
def test_every_a3_refuses_a_placement_distance_of_1(name):
    t = lookup(name)
    assert t.min_placement_distance == (2 if name.startswith("a3-") else 1)


@pytest.mark.parametrize("name", LISTED)
def test_only_stacks_that_install_with_apt_refuse_container_optimized_os(name):
    t = lookup(name)
    apt = t.net_stack in (NetStack.TCPXO, NetStack.RDMA)
    assert t.image_oses == (("ubuntu",) if apt else ("ubuntu", "cos"))
    assert t.image_os in t.image_oses  # the default image boots


def test_each_provisioning_model_has_its_price_or_none_and_flex_start_is_never_guessed():
    from gpufleet.catalog import MACHINE_PRICES

    for price in MACHINE_PRICES.values():
        assert price.usd_per_hour("standard") == price.on_demand_usd_per_hour
        assert price.usd_per_hour("spot") == price.spot_usd_per_hour < price.on_demand_usd_per_hour
        # The cited source carries no Flex-start price for any type.
        assert price.usd_per_hour("flex-start") is None


def test_the_cos_default_container_image_is_pinned_by_digest():
    import re

    from gpufleet.catalog import COS_DEFAULT_CONTAINER_IMAGE

    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:25\.01-py3@sha256:[0-9a-f]{64}", COS_DEFAULT_CONTAINER_IMAGE)
