"""Where the client's replicas are: a fixed list, a DNS name, or a file that is rewritten.

The client talks to replicas directly, with no proxy in between, so it must learn the replica
set itself. Every source answers the same question, `await source.urls()`: the whole current
set, normalized (lowercase scheme and host, canonical IP text, no trailing '/'), deduplicated
and sorted, so that the pool can diff two answers as sets and add or drain only what changed.

A failed lookup and an empty answer are kept apart on purpose:

* `DiscoveryError` (a timeout, SERVFAIL, no resolver reachable, an unreadable or invalid
  file) means "unknown": the caller keeps its previous list. Draining every replica because
  the resolver hiccuped would turn a DNS blip into an outage.
* `[]` means the source positively says there is no replica. For DNS that is NXDOMAIN or a
  name without address records: a Kubernetes headless Service with no ready pod answers
  NXDOMAIN (kubernetes/dns#245), so treating NXDOMAIN as an error would keep sending traffic
  to pods that are gone. The cost is that a misspelled name also reads as "no replicas";
  the caller should log an empty answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import urllib.parse
from collections.abc import Awaitable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.rdataclass
import dns.rdatatype
import dns.resolver

T = TypeVar("T")

URL_SCHEMES = frozenset({"http", "https", "grpc", "grpcs"})


class DiscoveryError(Exception):
    """The replica set could not be learned this time; keep the last one."""


class Source(Protocol):
    async def urls(self) -> list[str]:
        """The current replica base URLs, sorted and deduplicated.

        Raises `DiscoveryError` (or `OSError`) when the lookup fails.
        """
        ...


def normalize_url(url: str) -> str:
    """`url` in the one spelling every source produces; `ValueError` if it is no replica URL."""
    parts = urllib.parse.urlsplit(url.strip().rstrip("/"))
    scheme = url_scheme(parts.scheme)
    if not parts.hostname:
        raise ValueError(f"{url!r}: no host")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"{url!r}: a replica URL has no query, fragment or credentials")
    port = parts.port  # ValueError when not a number in 0-65535
    port_suffix = "" if port is None else f":{_port_number(port)}"
    return f"{scheme}://{_url_host(parts.hostname)}{port_suffix}{parts.path}"


def url_scheme(scheme: str) -> str:
    """`scheme` lowercased; `ValueError` unless replicas can be reached with it."""
    if scheme.lower() not in URL_SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {sorted(URL_SCHEMES)}")
    return scheme.lower()


def normalize_urls(urls: Sequence[str]) -> list[str]:
    if isinstance(urls, str):
        raise TypeError("pass a sequence of URLs, not one string")
    return sorted({normalize_url(url) for url in urls})


def _url_host(host: str) -> str:
    """Canonical text of an IP address (brackets around IPv6); other hosts lowercased."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


class StaticSource:
    """A list given once, in configuration or code."""

    __slots__ = ("_urls",)

    def __init__(self, urls: Sequence[str]) -> None:
        self._urls = normalize_urls(urls)

    async def urls(self) -> list[str]:
        return list(self._urls)

    def __repr__(self) -> str:
        return f"StaticSource({self._urls!r})"


class FileSource:
    """One URL per line in a file that an operator or a sidecar rewrites.

    Blank lines and '#' comments are ignored; a file without URLs means no replica (an empty
    list, as DNS's NXDOMAIN). The file is re-read only when its mtime, size
    or inode changed. A missing file, or any invalid line, raises `DiscoveryError` rather than
    `ValueError`: the file changes at runtime, and a typo in it should leave the pool on its
    last good list, not crash the poller. Rewrite it atomically (write a temporary file, then
    rename it over) so that a poll never reads half a file.
    """

    __slots__ = ("_stamp", "_urls", "path")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._urls: list[str] = []

    async def urls(self) -> list[str]:
        # A stat and a read of a few hundred bytes: cheaper than a hop to a thread.
        try:
            status = self.path.stat()
            stamp = (status.st_mtime_ns, status.st_size, status.st_ino)
            if stamp != self._stamp:
                self._urls = _parse_url_lines(self.path.read_text(encoding="utf-8"), self.path)
                self._stamp = stamp
        except (OSError, UnicodeDecodeError) as error:
            raise DiscoveryError(f"{self.path}: {error}") from error
        return list(self._urls)

    def __repr__(self) -> str:
        return f"FileSource({str(self.path)!r})"


def _parse_url_lines(text: str, path: Path) -> list[str]:
    urls = set()
    for number, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        try:
            urls.add(normalize_url(content))
        except ValueError as error:
            raise DiscoveryError(f"{path}:{number}: {error}") from error
    return sorted(urls)


class DnsSource:
    """Replicas behind a DNS name: its A and AAAA records, or SRV records.

    A/AAAA: every address of `name` becomes `scheme://address:port`. SRV (`srv=True`, or a
    name starting with '_' such as `_http._tcp.zerohop.default.svc.cluster.local`, which a
    Kubernetes headless Service publishes for a named port): every target's addresses, each
    with its record's port. Targets' addresses come from the answer's additional section when
    the server put them there, else from a lookup of the target. SRV priority and weight are
    ignored: every target is a replica, and the pool balances by load itself.

    `nameservers` (IP addresses, all on `nameserver_port`) replaces the system's resolv.conf.
    Names resolve as the system resolver would: resolv.conf's search list applies to names
    with fewer dots than its `ndots`. `timeout` bounds one whole `urls()` call. A/AAAA
    records are not merged across partial failures: if either lookup fails the call raises,
    since returning the half that answered would drain the other half's replicas.
    """

    __slots__ = (
        "_qname",
        "_resolver",
        "name",
        "nameserver_port",
        "nameservers",
        "port",
        "scheme",
        "srv",
        "timeout",
    )

    def __init__(
        self,
        name: str,
        *,
        port: int | None = None,
        scheme: str = "http",
        srv: bool | None = None,
        nameservers: Sequence[str] | None = None,
        nameserver_port: int = 53,
        timeout: float = 2.0,
    ) -> None:
        try:
            # Relative unless it ends in '.', so that resolv.conf's search list applies.
            self._qname = dns.name.from_text(name, origin=None)
        except dns.exception.DNSException as error:
            raise ValueError(f"{name!r}: not a DNS name ({error})") from error
        self.name = name
        self.srv = name.startswith("_") if srv is None else srv
        if self.srv and port is not None:
            raise ValueError("an SRV lookup takes each replica's port from its record")
        if not self.srv and port is None:
            raise ValueError("an A/AAAA lookup needs the replicas' port")
        self.port = None if port is None else _port_number(port)
        self.scheme = url_scheme(scheme)
        self.nameservers = None if nameservers is None else _nameserver_addresses(nameservers)
        self.nameserver_port = _port_number(nameserver_port)
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.timeout = timeout
        self._resolver: dns.asyncresolver.Resolver | None = None

    async def urls(self) -> list[str]:
        deadline = time.monotonic() + self.timeout
        if self.srv:
            urls = await self._srv_urls(deadline)
        else:
            assert self.port is not None
            addresses = await self._addresses(self._qname, deadline)
            urls = [self._url(address, self.port) for address in addresses]
        return sorted(set(urls))

    async def _srv_urls(self, deadline: float) -> list[str]:
        answer = await self._query(self._qname, dns.rdatatype.SRV, deadline)
        if answer is None or answer.rrset is None:
            return []
        # A target of "." means "no service here" (RFC 2782).
        targets = list({(r.target, r.port) for r in answer.rrset if r.target != dns.name.root})
        addresses = await _all(
            self._target_addresses(answer.response, target, deadline) for target, _ in targets
        )
        return [
            self._url(address, port)
            for (_, port), target_addresses in zip(targets, addresses, strict=True)
            for address in target_addresses
        ]

    async def _target_addresses(
        self, response: dns.message.Message, target: dns.name.Name, deadline: float
    ) -> list[str]:
        return _additional_addresses(response, target) or await self._addresses(target, deadline)

    async def _addresses(self, name: dns.name.Name, deadline: float) -> list[str]:
        """The A and AAAA addresses of `name`; [] when it has none or does not exist."""
        answers = await _all(
            self._query(name, rdtype, deadline) for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
        )
        return [r.address for a in answers if a is not None and a.rrset is not None for r in a]

    async def _query(
        self, name: dns.name.Name, rdtype: dns.rdatatype.RdataType, deadline: float
    ) -> dns.resolver.Answer | None:
        """One lookup: its answer (maybe without records), None on NXDOMAIN."""
        remaining = deadline - time.monotonic()
        label = f"{name} {dns.rdatatype.to_text(rdtype)}"
        if remaining <= 0:
            raise DiscoveryError(f"{label}: no time left of the {self.timeout}s timeout")
        try:
            return await self._get_resolver().resolve(
                name, rdtype, search=True, raise_on_no_answer=False, lifetime=remaining
            )
        except dns.resolver.NXDOMAIN:
            return None
        except (dns.exception.DNSException, OSError) as error:
            raise DiscoveryError(f"{label}: {error}") from error

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        # Built on first use: reading resolv.conf can fail, and that failure is a lookup's.
        if self._resolver is None:
            self._resolver = self._new_resolver()
        return self._resolver

    def _new_resolver(self) -> dns.asyncresolver.Resolver:
        if self.nameservers is None:
            try:
                resolver = dns.asyncresolver.Resolver()
            except dns.exception.DNSException as error:
                raise DiscoveryError(f"system resolver configuration: {error}") from error
        else:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = list(self.nameservers)
            resolver.port = self.nameserver_port
            # Without configuration dnspython takes the host's domain as a search suffix.
            resolver.domain = dns.name.root
        resolver.cache = None  # every poll must see the current records
        return resolver

    def _url(self, address: str, port: int) -> str:
        return normalize_url(f"{self.scheme}://{_url_host(address)}:{port}")

    def __repr__(self) -> str:
        target = self.name if self.port is None else f"{self.name}:{self.port}"
        kind = "srv" if self.srv else "a/aaaa"
        return f"DnsSource({target!r}, {kind}, scheme={self.scheme!r})"


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Results of concurrent lookups; the first error once all have finished."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if not isinstance(result, BaseException)]


def _additional_addresses(response: dns.message.Message, target: dns.name.Name) -> list[str]:
    addresses: list[str] = []
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        rrset = response.get_rrset(response.additional, target, dns.rdataclass.IN, rdtype)
        if rrset is not None:
            addresses.extend(r.address for r in rrset)
    return addresses


def _nameserver_addresses(nameservers: Sequence[str]) -> tuple[str, ...]:
    if isinstance(nameservers, str):
        raise TypeError("pass a sequence of nameserver addresses, not one string")
    if not nameservers:
        raise ValueError("nameservers is empty (None means the system's resolv.conf)")
    try:
        return tuple(ipaddress.ip_address(server).compressed for server in nameservers)
    except ValueError as error:
        raise ValueError(f"nameservers must be IP addresses: {error}") from error


def _port_number(port: int) -> int:
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not in 1-65535")
    return port


def source_from_spec(spec: str) -> Source:
    """The source a command-line or configuration string names.

    * `dns://name:port`, `dns+https://name:port`, `dns+grpc://name:port`: A/AAAA records;
    * `dns+srv://_http._tcp.name`, `dns+srv+grpc://...`: SRV records;
    * `file:/path/urls.txt`, `file:///abs/path/urls.txt`: a `FileSource`;
    * anything else: a comma-separated list of URLs (`StaticSource`).

    DNS specs take `?nameserver=ip:port` (repeatable; IPv6 as `[::1]:5353`) to ask that
    resolver instead of the system's.
    """
    parts = urllib.parse.urlsplit(spec.strip())
    scheme = parts.scheme.lower()
    if scheme == "dns" or scheme.startswith("dns+"):
        return _dns_source(parts)
    if scheme == "file":
        return _file_source(parts)
    urls = [url for url in spec.split(",") if url.strip()]
    if not urls:
        raise ValueError("empty replica spec")
    return StaticSource(urls)


def _dns_source(parts: urllib.parse.SplitResult) -> DnsSource:
    modifiers = parts.scheme.lower().split("+")[1:]
    srv = modifiers[:1] == ["srv"]
    url_schemes = modifiers[1:] if srv else modifiers
    if len(url_schemes) > 1 or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"{parts.geturl()!r}: expected dns[+srv][+scheme]://name[:port]")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    if set(query) - {"nameserver"}:
        raise ValueError(f"{parts.geturl()!r}: the only query parameter is nameserver")
    nameservers, nameserver_port = _parse_nameservers(query.get("nameserver", []))
    return DnsSource(
        parts.hostname,
        port=parts.port,
        scheme=url_schemes[0] if url_schemes else "http",
        srv=srv,
        nameservers=nameservers,
        nameserver_port=nameserver_port,
    )


def _parse_nameservers(values: list[str]) -> tuple[list[str] | None, int]:
    """`["127.0.0.1:5353", ...]` -> (addresses, their one shared port)."""
    if not values:
        return None, 53
    addresses, ports = [], set()
    for value in values:
        address, port = _split_host_port(value)
        addresses.append(address)
        ports.add(port)
    if len(ports) > 1:
        raise ValueError(f"nameservers on different ports: {values}")
    return addresses, ports.pop()


def _split_host_port(value: str) -> tuple[str, int]:
    if value.startswith("["):  # [v6]:port or [v6]
        host, _, rest = value[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    else:  # bare IPv4, or bare IPv6 without brackets
        host, port_text = value, ""
    return host, int(port_text) if port_text else 53


def _file_source(parts: urllib.parse.SplitResult) -> FileSource:
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(f"{parts.geturl()!r}: expected file:/path or file:///path")
    return FileSource(urllib.parse.unquote(parts.path))
