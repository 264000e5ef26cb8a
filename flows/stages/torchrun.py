"""``python -m flows.stages.torchrun <torchrun's arguments>``: torchrun (``torch.distributed.run``) with every
socket on one address.

Left alone, torchrun's rendezvous store listens on every interface (torch's TCPStore binds the wildcard
whatever host it is given) and each rank's gloo device on the address the hostname resolves to, often the
machine's network address. Here, before torchrun starts, machine 0 binds the store on ``--master_addr`` itself
(``bound_master_store``; port 0: a free one): torchrun's static rendezvous then opens its multi-tenant store
on that port and gets this one. On one machine the ranks' gloo and NCCL's bootstrap sockets listen on the
loopback interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``, unless the caller set them); across
machines on the address gloo and NCCL choose (the hostname's; NCCL: its first network interface), where the
other machines reach them. docs/security.md, "What listens where". GPUs and CPUs launch alike.
"""

from __future__ import annotations

import os
import sys

STORE_TIMEOUT_S = 900.0  # how long the store waits on a machine that has not joined yet (torchrun's default)


def main(argv: list[str]) -> int:
    from torch.distributed.run import parse_args, run

    from grpo_core.rollout.sockets import bound_master_store, loopback_interface

    args = parse_args(argv)
    if args.rdzv_backend != "static":
        raise SystemExit(f"flows.stages.torchrun: the static rendezvous only (--master_addr, --master_port), "
                         f"not --rdzv_backend {args.rdzv_backend}")
    if args.node_rank == 0:  # referenced until main returns: torchrun's store is this one
        store = bound_master_store(args.master_addr, args.master_port, STORE_TIMEOUT_S, multi_tenant=True)
        args.master_port = store.port
    loopback = loopback_interface()
    if str(args.nnodes) == "1" and loopback:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # gloo's sockets; NCCL's bootstrap
            os.environ.setdefault(variable, loopback)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
