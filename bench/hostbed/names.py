"""Every name a bed makes, derived from one short random token (several beds run at once on one machine).

Pure: no I/O. Interface names must fit the kernel's IFNAMSIZ (15 characters and a NUL), so they are
``pb<token><b|h|t><index>``: 2 + 6 + 1 + 2 = 11 characters at most for 100 hosts.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass

PREFIX = "pb"  # every namespace and interface of a bed starts with it; the sweep looks for it
IFNAMSIZ = 15
MAX_HOSTS = 100
# The host part of a bed's addresses: 10.<a>.<b>.0/24 from the token, so two beds' addresses differ too
# (they could not meet anyway: each bed's bridge lives in its own namespace).
_TOKEN = re.compile(r"^[0-9a-f]{6}$")
_HOST = re.compile(r"^[a-z][a-z0-9-]{0,15}$")


def new_token() -> str:
    return secrets.token_hex(3)


@dataclass(frozen=True)
class BedNames:
    token: str

    def __post_init__(self) -> None:
        if not _TOKEN.match(self.token):
            raise ValueError(f"bed token: got {self.token!r}, want 6 lowercase hex digits")

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.token}-br"

    def host_ns(self, host: str) -> str:
        if not _HOST.match(host):
            raise ValueError(f"host name: got {host!r}, want a lowercase letter then up to 15 of [a-z0-9-]")
        return f"{PREFIX}{self.token}-{host}"

    def _ifname(self, kind: str, index: int) -> str:
        if not 0 <= index < MAX_HOSTS:
            raise ValueError(f"host index: got {index}, want 0..{MAX_HOSTS - 1}")
        name = f"{PREFIX}{self.token}{kind}{index}"
        assert len(name) <= IFNAMSIZ, name
        return name

    def bridge_port(self, index: int) -> str:
        """The bridge's end of host `index`'s link (in the bridge namespace)."""
        return self._ifname("b", index)

    def host_link(self, index: int) -> str:
        """The host's end of its link before it is renamed eth0 inside the host's namespace."""
        return self._ifname("h", index)

    def subnet(self) -> ipaddress.IPv4Network:
        a, b = int(self.token[:2], 16), int(self.token[2:4], 16)
        return ipaddress.IPv4Network(f"10.{a}.{b}.0/24")

    def address(self, index: int) -> str:
        """Host `index`'s address: .1 upwards (the bridge itself has none)."""
        return str(self.subnet().network_address + 1 + index)

    def owns(self, name: str) -> bool:
        """Whether a namespace or interface name belongs to this bed."""
        return name.startswith(f"{PREFIX}{self.token}")


def is_token(text: str) -> bool:
    return bool(_TOKEN.match(text))


def token_of(name: str) -> str | None:
    """The bed token in a namespace name made by BedNames, or None for anyone else's name."""
    match = re.match(rf"^{PREFIX}([0-9a-f]{{6}})-", name)
    return match.group(1) if match else None
