"""`--engine` values: addresses used as they are, and DNS names that stand for every replica they resolve to."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

DEFAULT_ENGINE_PORT = 50052
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """One --engine value: `address` to connect to as it is, or, when `port` is set, a DNS name to resolve."""

    address: str
    port: int | None = None  # set only for a name to resolve: then `address` is the bare host name

    @property
    def resolvable(self) -> bool:
        return self.port is not None


def parse_targets(values: Iterable[str]) -> list[EngineTarget]:
    """--engine values (each comma-separated) -> targets: IP literals and scheme targets as they are, names
    (also `dns:///name:port`) to resolve. A missing port is DEFAULT_ENGINE_PORT. ValueError on a bad one."""
    targets: list[EngineTarget] = []
    for value in values:
        for raw in filter(None, (part.strip() for part in value.split(","))):
            target = _parse_target(raw)
            if target not in targets:
                targets.append(target)
    if not targets:
        raise ValueError("no engine target given")
    return targets


def _parse_target(raw: str) -> EngineTarget:
    if not raw.startswith("dns:///") and _has_scheme(raw):
        return EngineTarget(raw)  # unix:..., ipv4:..., dns://authority/...: gRPC's own target syntax, as it is
    host, port = _split_host_port(raw.removeprefix("dns:///"))
    return EngineTarget(format_address(host, port)) if _is_ip(host) else EngineTarget(host, port)


def _has_scheme(name: str) -> bool:
    scheme, _, rest = name.partition(":")
    return scheme.isalpha() and (rest.startswith("/") or scheme in ("unix", "unix-abstract", "ipv4", "ipv6"))


def _split_host_port(name: str) -> tuple[str, int]:
    if name.startswith("["):
        host, _, rest = name[1:].partition("]")
        port = rest.removeprefix(":") or str(DEFAULT_ENGINE_PORT)
    elif name.count(":") == 1:
        host, port = name.split(":")
    elif _is_ip(name) or ":" not in name:
        host, port = name, str(DEFAULT_ENGINE_PORT)
    else:
        raise ValueError(f"engine target {name!r}: write an IPv6 address as [ADDRESS]:PORT")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"engine target {name!r}: expected HOST:PORT")
    return host, int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_with_getaddrinfo(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (one per replica behind a headless Service), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({format_address(info[4][0], port) for info in infos})
