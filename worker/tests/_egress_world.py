"""A private outside world for egress tests (issue 32 item 5): nothing leaves this machine.

``blackholes()`` gives the host blackhole routes for every address the tests use, before the
first packet and removed after, so a wiring mistake drops packets here instead of sending
them anywhere. ``World`` makes two namespaces of the tests' own: ``EGRESS`` stands for
``egress_netns`` (readie wires sandboxes into it) and ``WORLD`` behind it holds HTTP servers
at an allowed, a denied and the metadata address, and an upstream resolver whose answers the
test can re-point.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import dns.exception
import dns.message
import dns.rcode
import dns.rrset

from readie_worker import _netns
from readie_worker.egress_net import EgressConfig, NetRules

N = ipaddress.IPv4Network
EGRESS, WORLD = "rdtest-egress", "rdtest-world"
ALLOWED, OTHER_ALLOWED, DENIED, METADATA = "10.199.1.1", "10.199.1.3", "10.199.2.1", "169.254.169.254"
# A public address (TEST-NET-3, documentation space: denied by nothing), for `true`.
PUBLIC = "203.0.113.80"
UPSTREAM_DNS = "10.199.5.53"
UPLINK_EGRESS, UPLINK_WORLD = "10.199.250.1", "10.199.250.2"
POOL = N("198.19.255.0/24")
PORT = 8000
# Every address a test packet may carry: the host routes them nowhere while tests run.
# (198.18.0.0/16: the pool a worker's sandboxes take their /30s from by default, egress_net.DEFAULT_POOL.)
TEST_PREFIXES = ("10.199.0.0/16", str(POOL), "198.18.0.0/16", "169.254.169.254/32", f"{PUBLIC}/32")
# What the policy layer would deny by default (private, loopback, link-local), for the tests.
DEFAULT_DENIED = tuple(N(net) for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "169.254.0.0/16"))
# For code in a sandbox: connect(address, port) -> [outcome, seconds], the outcome "ok" (an HTTP
# 200 from a world server), "timeout" or the errno's name. Source text: a sandbox imports nothing
# of the tests.
CONNECT = """
import errno, socket, time

def connect(address, port):
    started, sock = time.monotonic(), socket.socket()
    sock.settimeout(5)
    try:
        sock.connect((address, port))
        sock.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
        outcome = "ok" if sock.recv(100).startswith(b"HTTP/1.0 200") else "bad answer"
    except OSError as exc:
        outcome = "timeout" if isinstance(exc, TimeoutError) else errno.errorcode.get(exc.errno, str(exc))
    finally:
        sock.close()
    return [outcome, time.monotonic() - started]
"""
RULES = NetRules(
    networks=((N("10.199.1.0/24"), PORT),),
    names=(("allowed.test", None), ("*.api.test", PORT), ("rebind.test", None)),
    denied=DEFAULT_DENIED,
    opened=((N("10.199.1.0/24"), None),),  # the ceiling names it: the only private network open
)
NAMES = {"allowed.test": ALLOWED, "a.api.test": ALLOWED, "rebind.test": ALLOWED, "denied.test": DENIED, "public.test": PUBLIC}


def config(prefix: str = "rdt", table: str = "readietest") -> EgressConfig:
    return EgressConfig(netns=EGRESS, upstreams=(UPSTREAM_DNS,), pool=POOL, table=table, prefix=prefix)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if check and completed.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {completed.returncode}: {completed.stderr.strip()}")
    return completed


def require_tools() -> None:
    """Fail (never skip) without what the tests need."""
    missing = [tool for tool in ("ip", "nft", "nsenter", "unshare") if shutil.which(tool) is None]
    assert not missing, f"egress tests need {', '.join(missing)} (scripts/setup-host.sh installs them)"
    assert _run("id", "-u").stdout.strip() == "0", "egress tests need root (network namespaces, nftables)"


@contextlib.contextmanager
def blackholes() -> Iterator[None]:
    require_tools()
    added = []
    try:
        for prefix in TEST_PREFIXES:
            if _run("ip", "route", "add", "blackhole", prefix, check=False).returncode != 0:
                raise AssertionError(
                    f"cannot add the blackhole route for {prefix}: another egress test run holds it, or a crashed "
                    f"one left it (ip route del blackhole {prefix}); the tests never run without it"
                )
            added.append(prefix)
        yield
    finally:
        for prefix in added:
            _run("ip", "route", "del", "blackhole", prefix, check=False)


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = f"hello from {self.server.server_address[0]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Upstream:
    """A tiny authoritative resolver for the test names (``names`` may be re-pointed)."""

    def __init__(self) -> None:
        self.names = dict(NAMES)
        self.sock = _netns.call_in(WORLD, self._bind)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @staticmethod
    def _bind() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((UPSTREAM_DNS, 53))
        return sock

    def _serve(self) -> None:
        while True:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            try:
                query = dns.message.from_wire(wire)
                question = query.question[0]
                response = dns.message.make_response(query)
                address = self.names.get(question.name.to_text(omit_final_dot=True))
                if address is None:
                    response.set_rcode(dns.rcode.NXDOMAIN)
                elif question.rdtype == 1:
                    response.answer.append(dns.rrset.from_text(question.name, 1, "IN", "A", address))
                self.sock.sendto(response.to_wire(), peer)
            except OSError:  # closed under it: the world is going
                return
            except (dns.exception.DNSException, IndexError):  # not a query it answers: the next one
                continue

    def close(self) -> None:
        self.sock.close()


class World:
    def __init__(self) -> None:
        self.servers: list[ThreadingHTTPServer] = []
        self.upstream: Upstream | None = None
        self.udp_echo: socket.socket | None = None  # UDP echo at ALLOWED:PORT
        self.echoed_to: tuple[str, int] | None = None  # whom it last answered (a sandbox, NATed)

    def start(self) -> World:
        for name in (EGRESS, WORLD):
            _run("ip", "netns", "delete", name, check=False)  # the tests' own names: a crashed run's leftovers
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "link", "add", "rdtest-up", "netns", EGRESS, "type", "veth", "peer", "name", "up0", "netns", WORLD)
        _run("ip", "-n", EGRESS, "addr", "add", f"{UPLINK_EGRESS}/30", "dev", "rdtest-up")
        _run("ip", "-n", EGRESS, "link", "set", "rdtest-up", "up")
        _run("ip", "-n", EGRESS, "route", "add", "default", "via", UPLINK_WORLD)
        _run("ip", "-n", WORLD, "addr", "add", f"{UPLINK_WORLD}/30", "dev", "up0")
        _run("ip", "-n", WORLD, "link", "set", "up0", "up")
        for address in (ALLOWED, OTHER_ALLOWED, DENIED, METADATA, PUBLIC, UPSTREAM_DNS):
            _run("ip", "-n", WORLD, "addr", "add", f"{address}/32", "dev", "lo")
        for address in (ALLOWED, OTHER_ALLOWED, DENIED, METADATA, PUBLIC):
            server = _netns.call_in(WORLD, lambda a=address: ThreadingHTTPServer((a, PORT), _Hello))
            self.servers.append(server)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()  # quick shutdown
        self.upstream = Upstream()
        self.udp_echo = _netns.call_in(WORLD, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        self.udp_echo.bind((ALLOWED, PORT))
        threading.Thread(target=self._echo, daemon=True).start()
        return self

    def _echo(self) -> None:
        while True:
            try:
                data, peer = self.udp_echo.recvfrom(2048)
                self.echoed_to = peer
                self.udp_echo.sendto(data, peer)
            except OSError:
                return

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        if self.upstream is not None:
            self.upstream.close()
        if self.udp_echo is not None:
            self.udp_echo.close()
        for name in (EGRESS, WORLD):
            _run("ip", "netns", "delete", name, check=False)


@contextlib.contextmanager
def world() -> Iterator[World]:
    """Blackhole routes, then the two namespaces and their servers; all removed after."""
    with blackholes():
        made = World()
        try:
            yield made.start()
        finally:
            made.close()


def leftovers(prefix: str = "rdt", table: str = "readietest", *, table_closed: bool = True) -> list[str]:
    """What readie left of its wiring on this host: namespaces, veths, a sandbox's chains and
    sets, and (``table_closed``: once its EgressGateway is closed) readie's table itself."""
    found = [f"netns {line.split()[0]}" for line in _run("ip", "netns", "list").stdout.splitlines() if line.startswith(prefix + "-")]
    found += [f"veth {name}" for name in _netns.links(None, prefix + "v")]
    if _netns.present(EGRESS):
        found += [f"veth {name}" for name in _netns.links(EGRESS, prefix + "v")]
        ruleset = _run("nsenter", f"--net=/var/run/netns/{EGRESS}", "nft", "list", "ruleset").stdout
        ours = ruleset.partition(f"table inet {table} ")[2].partition("\ntable ")[0]
        found += [f"nft {line.strip()}" for line in ours.splitlines()
                  if line.strip().startswith(("chain sb_", "chain rf_", "set ")) and line.strip() != "set owners {"]
        owners = _run("nsenter", f"--net=/var/run/netns/{EGRESS}", "nft", "list", "set", "inet", table, "owners", check=False).stdout
        found += ["nft an element of set owners"] if "elements" in owners else []
        found += [f"nft table {table}"] if table_closed and f"table inet {table} " in ruleset else []
    return found
