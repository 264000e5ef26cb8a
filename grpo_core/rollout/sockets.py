"""Listening sockets bound to one address: torch's master TCPStore and gloo's default device listen wherever
torch chooses (the store on every interface, gloo on the address the machine's hostname resolves to), so the
stores and groups the rollout backends open are built here on the configured address instead.

Also the shared token of the vLLM server's endpoints (``GRPO_SERVER_TOKEN``, never params.yaml) and the test
of an address for "this machine only" that decides whether the server may start without one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Mapping

import torch

from grpo_core.common.errors import ConfigurationError

TOKEN_VARIABLE = "GRPO_SERVER_TOKEN"
LOOPBACK = "127.0.0.1"


def server_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """The vLLM server's shared token from the environment; None when unset or empty. ConfigurationError when
    it is not printable ASCII without spaces (an HTTP header carries it)."""
    token = environ.get(TOKEN_VARIABLE) or None
    if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
        raise ConfigurationError(f"{TOKEN_VARIABLE}: the token must be printable ASCII without spaces: an "
                                 "HTTP header carries it (its value is not shown here)")
    return token


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (an unresolvable name is not)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def is_wildcard(host: str) -> bool:
    """``0.0.0.0`` / ``::``: every interface, an address no peer can be told to connect to."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def local_address_towards(host: str, port: int) -> str:
    """This machine's address that connections to ``host:port`` leave from (the routing table's choice):
    where the trainer's end of the weight-sync group listens, reachable by the server and nothing wider."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: nothing is sent, the kernel only picks the route
        return probe.getsockname()[0]


def bound_master_store(host: str, port: int, timeout: float, world_size: int | None = None,
                       multi_tenant: bool = False) -> torch.distributed.TCPStore:
    """A master TCPStore listening on ``host:port`` only (port 0: a free one, read ``.port``). The socket is
    bound here and handed over (``master_listen_fd``): the store owns it from then on and closes it with
    itself. multi_tenant: a later multi-tenant master TCPStore on the same port in this process (torchrun's)
    shares this one's server instead of opening its own."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a restarted server rebinds its port while the last one's connections linger in TIME_WAIT
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
        bound_port = listener.getsockname()[1]
        store = torch.distributed.TCPStore(host, bound_port, world_size, is_master=True,
                                           timeout=datetime.timedelta(seconds=timeout),
                                           wait_for_workers=False, multi_tenant=multi_tenant,
                                           master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's now
    return store


def gloo_group(store: torch.distributed.Store, rank: int, size: int, timeout: float,
               address: str | None) -> torch.distributed.ProcessGroupGloo:
    """A gloo group whose own listening socket is on ``address`` (None: gloo's default device, the address the
    hostname resolves to)."""
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    device = (torch.distributed.ProcessGroupGloo.create_device(hostname=address) if address
              else torch.distributed.ProcessGroupGloo.create_default_device())
    options._devices = [device]
    return torch.distributed.ProcessGroupGloo(store, rank, size, options)


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` elsewhere), None when neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)
