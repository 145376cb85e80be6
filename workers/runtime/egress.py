"""Which addresses a webhook delivery may connect to: ``AGENTPOOL_WEBHOOK_NETWORKS``.

A run's webhook may point anywhere the workers reach. ``any`` (the default) checks nothing: the
receiver of an on-prem pool, or of a test, is often on a private network. ``public`` lets a delivery
connect only to a globally routable address: loopback, the private ranges, link-local (the cloud
metadata service at 169.254.169.254 among them), shared, reserved and multicast addresses are refused.
The check is made on each address the receiver's name resolves to, just before connecting to it, so
a name that resolves (or is rebound) to an internal address is refused as well. Networks written after
``public`` are allowed besides (``public 10.20.0.0/16 fd00:1::/64``: an internal receiver you trust).

No import beyond the standard library: the settings parse it."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

SETTING = "AGENTPOOL_WEBHOOK_NETWORKS"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# NAT64's well-known prefix: an IPv6-only network's way to an IPv4 address, which is the one checked.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class AddressRefused(Exception):
    """The receiver's address is outside the networks deliveries may reach (a refusal of the pool's
    policy, not a failure of the receiver: trying again would meet it again)."""


@dataclass(frozen=True)
class Networks:
    """``public_only``: refuse addresses that are not globally routable, but those in ``allowed``."""

    public_only: bool = False
    allowed: tuple[Network, ...] = ()

    def check(self, address: str) -> None:
        """Raise :class:`AddressRefused` if a delivery may not connect to ``address`` (an IP address as
        ``getaddrinfo`` gives it, an IPv6 one possibly with its ``%scope``)."""
        if not self.public_only:
            return
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        elif isinstance(ip, ipaddress.IPv6Address) and ip in NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if any(ip in network for network in self.allowed):
            return
        # is_global alone lets multicast through, and what it counts has moved between Python releases:
        # each kind of address that is not the internet's is named too.
        internal = (
            not ip.is_global
            or ip.is_private
            or ip.is_loopback
            or ip.is_link_local
            or ip.is_multicast
            or ip.is_reserved
            or ip.is_unspecified
        )
        if internal:
            raise AddressRefused(f"{ip} is not a public address ({SETTING}={self}); the delivery is not sent")

    def check_url(self, url: str) -> None:
        """``check`` the host of ``url`` if it is an IP address (a name is checked once resolved)."""
        host = urlsplit(url).hostname or ""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return
        self.check(host)

    def __str__(self) -> str:
        return " ".join(["public", *map(str, self.allowed)]) if self.public_only else "any"


def parse(raw: str) -> Networks:
    """``AGENTPOOL_WEBHOOK_NETWORKS``'s value: ``any`` (or empty), or ``public`` and any networks
    allowed besides. A ValueError in one line otherwise."""
    words = raw.replace(",", " ").split()
    if not words or words == ["any"]:
        return Networks()
    if words[0] != "public":
        raise ValueError(
            f"{SETTING} must be 'any' or 'public', then any networks allowed besides "
            f"('public 10.20.0.0/16'); got {raw.strip()[:100]!r}"
        )
    allowed = []
    for word in words[1:]:
        try:
            allowed.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            raise ValueError(
                f"{SETTING}: {word[:60]!r} is not a network (10.20.0.0/16, fd00:1::/64 or one address)"
            ) from None
    return Networks(public_only=True, allowed=tuple(allowed))
