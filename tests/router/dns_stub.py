"""A DNS server the test controls: answers A/AAAA queries for the names it
holds from a dict, on a free UDP port of 127.0.0.1 (dnspython's message
codec; one thread). Names it does not hold answer NXDOMAIN."""

from __future__ import annotations

import ipaddress
import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class DnsStub:
    """``records[name]`` → the addresses it answers (an empty list: the name
    exists with no address, NOERROR with no answer). Change ``records`` at
    will; ``queries`` counts the questions asked. Stop with :meth:`stop`.
    """

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns stub", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            query = dns.message.from_wire(wire)
            self._sock.sendto(self._answer(query).to_wire(), peer)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        self.queries += 1
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        if name not in self.records:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response
        want = 4 if question.rdtype == dns.rdatatype.A else 6
        addresses = [a for a in self.records[name] if ipaddress.ip_address(a).version == want]
        if addresses:
            response.answer.append(dns.rrset.from_text_list(
                question.name, 1, "IN", dns.rdatatype.to_text(question.rdtype), addresses))
        return response

    def stop(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._thread.join(timeout=2)
