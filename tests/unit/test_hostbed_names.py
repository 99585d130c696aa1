"""The multi-host bed's names (bench/hostbed/names.py): unique per bed, within the kernel's limits."""

from __future__ import annotations

import pytest

from bench.hostbed.names import IFNAMSIZ, MAX_HOSTS, BedNames, is_token, token_of


def test_every_interface_name_fits_ifnamsiz_and_carries_the_token() -> None:
    names = BedNames("a1b2c3")
    for index in (0, MAX_HOSTS - 1):
        for name in (names.bridge_port(index), names.host_link(index)):
            assert len(name) <= IFNAMSIZ and names.owns(name), name
    assert names.bridge_port(3) != names.host_link(3)


def test_namespaces_name_their_bed_and_no_other() -> None:
    names = BedNames("a1b2c3")
    assert token_of(names.host_ns("ps0")) == "a1b2c3" == token_of(names.bridge_ns)
    assert token_of("pb-something-else") is None and token_of("netns1") is None
    assert not BedNames("ffffff").owns(names.host_ns("ps0"))


def test_addresses_are_one_subnet_per_bed_from_dot_one() -> None:
    names = BedNames("0a0b0c")
    assert str(names.subnet()) == "10.10.11.0/24"
    assert [names.address(i) for i in (0, 1)] == ["10.10.11.1", "10.10.11.2"]


@pytest.mark.parametrize("bad", ["A1B2C3", "a1b2", "zzzzzz", "a1b2c3d"])
def test_a_bad_token_is_refused_with_its_value(bad: str) -> None:
    assert not is_token(bad)
    with pytest.raises(ValueError, match=repr(bad)):
        BedNames(bad)


def test_a_bad_host_name_or_index_is_refused_with_its_value() -> None:
    with pytest.raises(ValueError, match="'PS_0'"):
        BedNames("a1b2c3").host_ns("PS_0")
    with pytest.raises(ValueError, match="got 100"):
        BedNames("a1b2c3").bridge_port(MAX_HOSTS)
