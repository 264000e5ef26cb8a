"""What a multi-process train stage listens on: the CPU launcher (``flows.stages.torchrun``) keeps torchrun's
rendezvous store and the ranks' gloo sockets on loopback, where torchrun as it ships listens on every
interface. Both are run here with two ranks that list the listening sockets of their launch while the group
is up (psutil, as ``ss -ltnp`` shows them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flows.stages.launch import launch_command
from tests.test_pipeline import REPO

WORKER = """
import json, os, sys
import psutil, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:
    launcher = psutil.Process(os.getppid())
    pids = {launcher.pid, *(p.pid for p in launcher.children(recursive=True))}
    listening = sorted({c.laddr.ip for c in psutil.net_connections(kind="tcp")
                        if c.pid in pids and c.status == psutil.CONN_LISTEN})
    ports = [c.laddr.port for c in psutil.net_connections(kind="tcp")
             if c.pid in pids and c.status == psutil.CONN_LISTEN]
    with open(sys.argv[1], "w") as fh:
        json.dump({"addresses": listening, "sockets": len(ports), "master_port": os.environ["MASTER_PORT"],
                   "ports": ports}, fh)
dist.barrier()
dist.destroy_process_group()
"""


def listening(tmp_path: Path, launcher: list[str], name: str) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([*launcher, str(script), str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_two_process_launch_listens_on_loopback_only(tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    ours = listening(tmp_path, launch_command(2), "ours")
    # the store (torchrun's, on the port the launcher bound) and each rank's gloo socket
    assert ours["addresses"] == ["127.0.0.1"] and ours["sockets"] >= 3, ours
    assert int(ours["master_port"]) in ours["ports"]
    as_shipped = listening(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc_per_node", "2"], "as-shipped")
    assert {"0.0.0.0", "::"} & set(as_shipped["addresses"]), as_shipped  # what the launcher is for


def test_the_launcher_takes_the_static_rendezvous_only():
    proc = subprocess.run([sys.executable, "-m", "flows.stages.torchrun", "--rdzv_backend", "c10d",
                           "--rdzv_endpoint", "127.0.0.1:0", "--nproc_per_node", "1", "x.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "the static rendezvous only" in proc.stderr and "c10d" in proc.stderr
