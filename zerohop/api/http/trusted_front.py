"""The end user a trusted front names (`--trusted-front`): Anthropic's `claude gateway` with
`forward_user_identity: true`, or a LiteLLM proxy, in front of zerohop.

`claude gateway` sends `x-claude-gateway-user-id` (the SSO subject), `x-claude-gateway-user-
email` and `x-litellm-end-user-id` (the email), each printable ASCII with anything else
percent-encoded; LiteLLM sends `x-litellm-end-user-id` alone. They are believed only from a
peer inside the trusted networks, the peer as the ASGI scope's `client` gives it (after
uvicorn's proxy-headers handling for --forwarded-allow-ips); from anyone else they are
ignored, so a client cannot name itself someone else.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote

USER_ID = b"x-claude-gateway-user-id"
USER_EMAIL = b"x-claude-gateway-user-email"
LITELLM_USER = b"x-litellm-end-user-id"
MAX_CHARS = 256  # a longer value is cut: the audit log is not a store for arbitrary bytes

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(slots=True, frozen=True)
class EndUser:
    user: str | None = None
    email: str | None = None


NOBODY = EndUser()


@dataclass(slots=True, frozen=True)
class TrustedFront:
    """The networks whose identity headers are believed; none by default."""

    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, text: str) -> TrustedFront:
        """From a comma-separated list of IP addresses and CIDR networks ("" for none);
        ValueError naming the entry that is neither."""
        networks = []
        for entry in filter(None, (part.strip() for part in text.split(","))):
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an IP address or a CIDR network (such as 10.0.0.0/8)"
                ) from None
        return cls(tuple(networks))

    def trusts(self, host: str | None) -> bool:
        if not self.networks or host is None:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:  # a unix socket's path, a name: never a trusted front
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)

    def end_user(
        self, client: tuple[str, int] | list[object] | None, headers: Iterable[tuple[bytes, bytes]]
    ) -> EndUser:
        """The end user the request's headers name, if its peer is a trusted front."""
        host = str(client[0]) if client else None
        if not self.trusts(host):
            return NOBODY
        found: dict[bytes, str] = {}
        for name, value in headers:
            wanted = name in (USER_ID, USER_EMAIL, LITELLM_USER) and name not in found
            if wanted and (text := _clean(value)) is not None:
                found[name] = text
        return EndUser(found.get(USER_ID) or found.get(LITELLM_USER), found.get(USER_EMAIL))


def _clean(value: bytes) -> str | None:
    """The header's text, percent-decoded, without control characters; None if empty."""
    text = unquote(value.decode("latin-1").strip(), errors="replace")
    text = "".join(ch for ch in text if ch.isprintable())[:MAX_CHARS]
    return text or None
