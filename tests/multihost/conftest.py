"""Test hosts for the multi-host tests: made once per module, healed between tests, removed at the end (also after
a failure). Skipped, with the reason, where they cannot be made (no root, no iproute2, no network namespaces)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.hosts import TestHosts, unavailable_reason


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made = TestHosts(3)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def fresh(hosts: TestHosts) -> Iterator[TestHosts]:
    """The module's hosts, every process of an earlier test gone and every link up, before and after the test."""
    hosts.heal()
    try:
        yield hosts
    finally:
        hosts.heal()
