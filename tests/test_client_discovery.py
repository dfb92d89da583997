"""zerohop.client's replica discovery: DNS (A, AAAA, SRV) against a real DNS server on a
local port, a file rewritten under the client, a static list, and the spec strings naming them.

What matters most: a lookup that fails raises (the pool keeps its replicas), while a name that
is gone answers [] (the pool drains them); the two must never be confused.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dns_server import DnsServer
from zerohop.client.discovery import (
    DiscoveryError,
    DnsSource,
    FileSource,
    Source,
    StaticSource,
    normalize_url,
    source_from_spec,
)

NAME = "zerohop.test"
SRV_NAME = "_http._tcp.zerohop.test"


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


def dns_source(
    server: DnsServer,
    name: str = NAME,
    *,
    port: int | None = None,
    scheme: str = "http",
    srv: bool | None = None,
    timeout: float = 2.0,
) -> DnsSource:
    """A source asking `server` only."""
    return DnsSource(
        name,
        port=port,
        scheme=scheme,
        srv=srv,
        nameservers=["127.0.0.1"],
        nameserver_port=server.port,
        timeout=timeout,
    )


def urls(source: Source) -> list[str]:
    return asyncio.run(source.urls())


# DNS: A and AAAA


def test_a_records_become_sorted_urls(dns_server: DnsServer) -> None:
    dns_server.set_a(NAME, ["10.0.0.2", "10.0.0.1"])
    assert urls(dns_source(dns_server, port=8000)) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    ]


def test_aaaa_records_are_bracketed(dns_server: DnsServer) -> None:
    dns_server.set_aaaa(NAME, ["fd00::0001"])
    assert urls(dns_source(dns_server, port=8000, scheme="grpc")) == ["grpc://[fd00::1]:8000"]


def test_a_and_aaaa_together(dns_server: DnsServer) -> None:
    dns_server.set_a(NAME, ["10.0.0.1"])
    dns_server.set_aaaa(NAME, ["fd00::1"])
    assert urls(dns_source(dns_server, port=80)) == ["http://10.0.0.1:80", "http://[fd00::1]:80"]


def test_answers_change_between_calls(dns_server: DnsServer) -> None:
    source = dns_source(dns_server, port=8000)
    dns_server.set_a(NAME, ["10.0.0.1"])
    assert urls(source) == ["http://10.0.0.1:8000"]
    dns_server.set_a(NAME, ["10.0.0.1", "10.0.0.3"])
    assert urls(source) == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    dns_server.set_a(NAME, ["10.0.0.3"])
    assert urls(source) == ["http://10.0.0.3:8000"]


def test_a_name_that_is_gone_answers_an_empty_list(dns_server: DnsServer) -> None:
    source = dns_source(dns_server, port=8000)
    assert urls(source) == [], "NXDOMAIN: a headless Service without ready pods"
    dns_server.set_a(NAME, [])
    assert urls(source) == [], "NODATA: the name exists without addresses"


# DNS: SRV


def test_srv_uses_the_additional_section_when_present(dns_server: DnsServer) -> None:
    dns_server.set_srv(SRV_NAME, [(0, 50, 8000, "pod-a.zerohop.test"), (0, 50, 8001, "pod-b")])
    dns_server.set_a("pod-a.zerohop.test", ["10.0.0.1"])
    dns_server.set_aaaa("pod-a.zerohop.test", ["fd00::1"])
    dns_server.set_a("pod-b", ["10.0.0.2"])
    assert urls(dns_source(dns_server, SRV_NAME)) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8001",
        "http://[fd00::1]:8000",
    ]
    assert [kind for _, kind in dns_server.queries()] == ["SRV"], "targets came with the answer"


def test_srv_resolves_targets_missing_from_the_additional_section(dns_server: DnsServer) -> None:
    dns_server.additional = False
    dns_server.set_srv(SRV_NAME, [(0, 50, 9000, "pod-a.zerohop.test"), (0, 50, 9000, "gone")])
    dns_server.set_aaaa("pod-a.zerohop.test", ["fd00::1"])
    source = dns_source(dns_server, SRV_NAME, scheme="grpc", srv=True)
    assert urls(source) == ["grpc://[fd00::1]:9000"], "a target already gone adds nothing"
    assert ("pod-a.zerohop.test.", "AAAA") in dns_server.queries()


def test_srv_is_chosen_by_a_leading_underscore_and_takes_no_port(dns_server: DnsServer) -> None:
    assert dns_source(dns_server, SRV_NAME).srv
    assert not dns_source(dns_server, port=80).srv
    with pytest.raises(ValueError, match="port"):
        dns_source(dns_server, SRV_NAME, port=80)
    with pytest.raises(ValueError, match="port"):
        dns_source(dns_server)


def test_srv_name_that_is_gone_answers_an_empty_list(dns_server: DnsServer) -> None:
    assert urls(dns_source(dns_server, SRV_NAME)) == []


# DNS: failures must raise, not drain the pool


def test_servfail_raises(dns_server: DnsServer) -> None:
    dns_server.set_a(NAME, ["10.0.0.1"])
    dns_server.failure = "servfail"
    with pytest.raises(DiscoveryError):
        urls(dns_source(dns_server, port=8000))


def lifetimes_asked(source: DnsSource) -> list[float]:
    """The `lifetime` each of `source`'s lookups hands dnspython (its real resolver still
    answers), filled in as they are made."""
    resolver = source._get_resolver()
    resolve, asked = resolver.resolve, []

    async def spy(*args: object, **kwargs: object) -> object:
        asked.append(kwargs["lifetime"])
        return await resolve(*args, **kwargs)

    resolver.resolve = spy
    return asked


def test_an_unanswered_query_raises_within_the_timeout(dns_server: DnsServer) -> None:
    dns_server.set_a(NAME, ["10.0.0.1"])
    dns_server.failure = "drop"
    source = dns_source(dns_server, port=8000, timeout=0.3)
    asked = lifetimes_asked(source)
    with pytest.raises(DiscoveryError, match="lifetime expired"):
        urls(source)
    assert ("zerohop.test.", "A") in dns_server.queries()  # asked, and never answered
    # Each lookup was bounded by what was left of the 0.3 s, not dnspython's default 5 s.
    assert len(asked) == 2 and all(0 < lifetime <= 0.3 for lifetime in asked)
    dns_server.failure = None
    assert urls(dns_source(dns_server, port=8000)) == ["http://10.0.0.1:8000"]


def test_a_failing_srv_target_lookup_raises(dns_server: DnsServer) -> None:
    dns_server.additional = False
    dns_server.set_srv(SRV_NAME, [(0, 50, 8000, "pod-a.zerohop.test"), (0, 50, 8000, "pod-b")])
    dns_server.set_a("pod-a.zerohop.test", ["10.0.0.1"])
    dns_server.set_a("pod-b", ["10.0.0.2"])
    both = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert urls(dns_source(dns_server, SRV_NAME)) == both
    source = dns_source(dns_server, SRV_NAME, timeout=1.0)  # short: "drop" waits it out
    for failure in ("servfail", "drop"):
        dns_server.fail("pod-b", failure)
        with pytest.raises(DiscoveryError, match="pod-b"):
            urls(source)  # not pod-a alone: that would drain pod-b


def test_dns_source_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="scheme"):
        DnsSource(NAME, port=80, scheme="ftp")
    with pytest.raises(ValueError, match="IP"):
        DnsSource(NAME, port=80, nameservers=["dns.example"])
    with pytest.raises(ValueError, match="port"):
        DnsSource(NAME, port=70000)


# File


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def test_file_source_skips_comments_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "replicas.txt"
    path.write_text(
        "# the fleet\n\nhttp://10.0.0.2:8000/\n  HTTP://10.0.0.1:8000  # primary\n"
        "http://10.0.0.2:8000\n"
    )
    assert urls(FileSource(path)) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_file_source_picks_up_a_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "replicas.txt"
    write_atomically(path, "http://10.0.0.1:8000\n")
    source = FileSource(path)
    assert urls(source) == ["http://10.0.0.1:8000"]
    write_atomically(path, "http://10.0.0.1:8000\nhttp://10.0.0.2:8000\n")
    assert urls(source) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_file_source_rereads_only_when_the_file_changed(tmp_path: Path) -> None:
    path = tmp_path / "replicas.txt"
    path.write_text("http://10.0.0.1:8000\n")
    source = FileSource(path)
    assert urls(source) == ["http://10.0.0.1:8000"]
    before = path.stat()
    path.write_text("http://10.0.0.9:8000\n")  # same size, in place
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert urls(source) == ["http://10.0.0.1:8000"], "same mtime, size and inode: cached"
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    assert urls(source) == ["http://10.0.0.9:8000"]


def test_file_source_errors_are_discovery_errors(tmp_path: Path) -> None:
    path = tmp_path / "replicas.txt"
    source = FileSource(path)
    with pytest.raises(DiscoveryError, match=r"replicas\.txt"):
        urls(source)
    path.write_text("http://10.0.0.1:8000\nftp://10.0.0.2\n")
    with pytest.raises(DiscoveryError, match=r"replicas\.txt:2"):
        urls(source)
    write_atomically(path, "http://10.0.0.1:8000\n")
    assert urls(source) == ["http://10.0.0.1:8000"]


# Static list and URL normalization


def test_static_source_normalizes_deduplicates_and_sorts() -> None:
    source = StaticSource(
        [
            "https://B.example:443/",
            "grpc://[FD00::0001]:50051",
            "https://b.example:443",
            "grpcs://a",
        ]
    )
    assert urls(source) == ["grpc://[fd00::1]:50051", "grpcs://a", "https://b.example:443"]


@pytest.mark.parametrize(
    "url",
    ["ftp://host", "host:8000", "http://", "http://host:99999", "http://host?x=1", "http://u@h"],
)
def test_invalid_urls_are_rejected(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_url(url)
    with pytest.raises(ValueError):
        StaticSource([url])


def test_static_source_wants_a_sequence_not_a_string() -> None:
    with pytest.raises(TypeError):
        StaticSource("http://host:8000")


# Specs


@pytest.mark.parametrize(
    ("scheme", "expected"),
    [("dns", "http"), ("dns+https", "https"), ("dns+grpc", "grpc"), ("DNS+GRPCS", "grpcs")],
)
def test_dns_spec(dns_server: DnsServer, scheme: str, expected: str) -> None:
    dns_server.set_a(NAME, ["10.0.0.1"])
    source = source_from_spec(f"{scheme}://{NAME}:8000?nameserver={dns_server.nameserver}")
    assert isinstance(source, DnsSource) and not source.srv
    assert urls(source) == [f"{expected}://10.0.0.1:8000"]


@pytest.mark.parametrize(("scheme", "expected"), [("dns+srv", "http"), ("dns+srv+grpc", "grpc")])
def test_dns_srv_spec(dns_server: DnsServer, scheme: str, expected: str) -> None:
    dns_server.set_srv(SRV_NAME, [(0, 50, 8000, "pod-a.zerohop.test")])
    dns_server.set_a("pod-a.zerohop.test", ["10.0.0.1"])
    source = source_from_spec(f"{scheme}://{SRV_NAME}?nameserver={dns_server.nameserver}")
    assert isinstance(source, DnsSource) and source.srv
    assert urls(source) == [f"{expected}://10.0.0.1:8000"]


def test_dns_spec_nameserver_forms() -> None:
    source = source_from_spec("dns://name:80?nameserver=[::1]:5353&nameserver=127.0.0.1:5353")
    assert isinstance(source, DnsSource)
    assert (source.nameservers, source.nameserver_port) == (("::1", "127.0.0.1"), 5353)
    source = source_from_spec("dns://name:80?nameserver=10.0.0.53")
    assert isinstance(source, DnsSource)
    assert (source.nameservers, source.nameserver_port) == (("10.0.0.53",), 53)
    source = source_from_spec("dns://name:80")
    assert isinstance(source, DnsSource) and source.nameservers is None


@pytest.mark.parametrize(
    "spec",
    [
        "dns://name",  # A/AAAA without a port
        "dns+srv://_http._tcp.name:80",  # the port comes from the records
        "dns+ftp://name:80",
        "dns+grpc+https://name:80",
        "dns://name:80/path",
        "dns://name:80?resolver=1.1.1.1",
        "dns://name:80?nameserver=1.1.1.1:53&nameserver=8.8.8.8:5353",
        "file://otherhost/urls.txt",
        "",
        "ftp://host",
    ],
)
def test_invalid_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        source_from_spec(spec)


@pytest.mark.parametrize("prefix", ["file:", "file://"])
def test_file_spec(tmp_path: Path, prefix: str) -> None:
    path = tmp_path / "replica urls.txt"
    path.write_text("http://10.0.0.1:8000\n")
    source = source_from_spec(prefix + str(path).replace(" ", "%20"))
    assert isinstance(source, FileSource) and source.path == path
    assert urls(source) == ["http://10.0.0.1:8000"]


def test_static_spec() -> None:
    source = source_from_spec("http://10.0.0.2:8000/, http://10.0.0.1:8000")
    assert isinstance(source, StaticSource)
    assert urls(source) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
