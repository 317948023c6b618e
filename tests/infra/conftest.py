"""Run the Pulumi program under Pulumi's mocks once per distinct config and share the result."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from infra.preview import Preview, preview_program

BASE = {"gcp:project": "gpufleet-test", "gcp:zone": "us-central1-a"}

_CACHE: dict[str, Preview] = {}


@pytest.fixture(scope="session")
def fleet() -> Callable[..., Preview]:
    """`fleet(machineType="a3-megagpu-8g", nodes=2, ...)`: the preview of that stack config
    (gpufleet keys by short name; gcp:project/zone preset). Same config, same (cached) run."""

    def run(stack: str = "dev", **keys: Any) -> Preview:
        config = {**BASE, **{(k if ":" in k else f"gpufleet:{k}"): v for k, v in keys.items()}}
        cache_key = json.dumps([stack, config], sort_keys=True)
        if cache_key not in _CACHE:
            _CACHE[cache_key] = preview_program(config, stack=stack)
        return _CACHE[cache_key]

    return run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Importing pulumi_gcp warns about its own deprecated aliases (MangedSslCertificate, ...),
    # which this program does not use; keep them out of the test report.
    here = str(__file__).rsplit("/", 1)[0]
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.filterwarnings(r"ignore:gcp\..* has been deprecated:DeprecationWarning"))
