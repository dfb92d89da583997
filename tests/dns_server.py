"""A real DNS server for tests: UDP on 127.0.0.1, with records that change while it runs.

Discovery is tested against real packets and dnspython's real resolver, not mocks, so that
NXDOMAIN vs NODATA, the additional section and timeouts behave as they do in a cluster.

    with DnsServer() as server:
        server.set_a("zerohop.test", ["10.0.0.1"])
        DnsSource("zerohop.test", port=8000, nameservers=["127.0.0.1"],
                  nameserver_port=server.port)

A name never set (or `remove`d) answers NXDOMAIN; a name set with no records of the asked
type answers NOERROR without records (NODATA). `failure = "servfail"` or `"drop"` makes every
query fail that way until it is set back to None; `fail(name, ...)` fails one name's queries.
Every method may be called from any thread.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Literal

import dns.exception
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

TTL = 0  # nothing may cache: tests change records between lookups
SrvRecord = tuple[int, int, int, str]  # priority, weight, port, target
Failure = Literal["servfail", "drop"]


class DnsServer:
    def __init__(self, *, additional: bool = True) -> None:
        self.additional = additional  # put SRV targets' A/AAAA records in the answer
        self.failure: Failure | None = None
        self._records: dict[dns.name.Name, dict[dns.rdatatype.RdataType, list[str]]] = {}
        self._failures: dict[dns.name.Name, Failure] = {}
        self._queries: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self.host, self.port = self._socket.getsockname()
        self._thread = threading.Thread(target=self._serve, name="test-dns", daemon=True)
        self._thread.start()

    @property
    def nameserver(self) -> str:
        """`host:port`, as a spec's `?nameserver=` takes it."""
        return f"{self.host}:{self.port}"

    def set_a(self, name: str, addresses: Iterable[str]) -> None:
        self._set(name, dns.rdatatype.A, list(addresses))

    def set_aaaa(self, name: str, addresses: Iterable[str]) -> None:
        self._set(name, dns.rdatatype.AAAA, list(addresses))

    def set_srv(self, name: str, records: Iterable[SrvRecord]) -> None:
        texts = [
            f"{priority} {weight} {port} {dns.name.from_text(target)}"
            for priority, weight, port, target in records
        ]
        self._set(name, dns.rdatatype.SRV, texts)

    def remove(self, name: str) -> None:
        """Forget `name`: it answers NXDOMAIN from now on."""
        with self._lock:
            self._records.pop(dns.name.from_text(name), None)

    def fail(self, name: str, failure: Failure | None) -> None:
        """Fail the queries for `name` that way (None: answer them again)."""
        with self._lock:
            if failure is None:
                self._failures.pop(dns.name.from_text(name), None)
            else:
                self._failures[dns.name.from_text(name)] = failure

    def queries(self) -> list[tuple[str, str]]:
        """(name, type) of every query so far, e.g. ("zerohop.test.", "A")."""
        with self._lock:
            return list(self._queries)

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._socket.sendto(b"", (self.host, self.port))  # wakes the blocked recvfrom
        self._thread.join(timeout=5)
        self._socket.close()

    def __enter__(self) -> DnsServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _set(self, name: str, rdtype: dns.rdatatype.RdataType, texts: list[str]) -> None:
        with self._lock:
            self._records.setdefault(dns.name.from_text(name), {})[rdtype] = texts

    def _serve(self) -> None:
        try:
            while True:
                wire, client = self._socket.recvfrom(65535)
                if self._closing.is_set():
                    return
                response = self._respond(wire)
                if response is not None:
                    self._socket.sendto(response, client)
        except OSError:  # the socket was closed under us
            return

    def _respond(self, wire: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        response = dns.message.make_response(query)
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        with self._lock:
            self._queries.append((question.name.to_text(), dns.rdatatype.to_text(question.rdtype)))
            failure = self.failure or self._failures.get(question.name)
            if failure == "drop":
                return None
            if failure == "servfail":
                response.set_rcode(dns.rcode.SERVFAIL)
            else:
                self._answer(response, question.name, question.rdtype)
        return response.to_wire()

    def _answer(
        self, response: dns.message.Message, name: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> None:
        if name not in self._records:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return
        texts = self._records[name].get(rdtype, [])
        if texts:
            response.answer.append(self._rrset(name, rdtype, texts))
        if rdtype == dns.rdatatype.SRV and self.additional:
            for target in {dns.name.from_text(text.split()[3]) for text in texts}:
                for address_type in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    addresses = self._records.get(target, {}).get(address_type, [])
                    if addresses:
                        response.additional.append(self._rrset(target, address_type, addresses))

    @staticmethod
    def _rrset(
        name: dns.name.Name, rdtype: dns.rdatatype.RdataType, texts: list[str]
    ) -> dns.rrset.RRset:
        return dns.rrset.from_text(name, TTL, dns.rdataclass.IN, rdtype, *texts)
