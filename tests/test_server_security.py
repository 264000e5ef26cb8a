"""What listens where, and who may push weights (docs/security.md): the weight-sync group's rendezvous store
and gloo sockets bind the configured host only; with ``GRPO_SERVER_TOKEN`` set, flows.serve's endpoints
refuse a request without it (nothing changes: weights, version, group) and the trainer's client sends it; the
server refuses to start on a non-loopback address without one; the weights version is the one the trainer
sent over its group, not a request body's; an answer that is not the protocol's is a classified error naming
host:port.

"Another local address": Linux routes all of 127.0.0.0/8 to the loopback interface, so a socket bound to
127.0.0.1 refuses a connection to 127.0.0.2, while one bound to every interface accepts it. The machine's own
non-loopback address, where it has one, is tried too.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.common.errors import EXIT_CONFIG, EXIT_ERROR, ConfigurationError, exit_code_for
from grpo_core.rollout import HFGenerateBackend, Placement, SamplingParams
from grpo_core.rollout.sockets import TOKEN_VARIABLE, is_loopback, local_address_towards
from grpo_core.rollout.vllm_server import (
    SERVER_RANK,
    TRAINER_RANK,
    ServerConnection,
    VLLMServerBackend,
    VLLMServerBadAnswer,
    VLLMServerError,
    VLLMServerRefused,
    WeightGroup,
    rendezvous_store,
)
from tests.test_vllm_server import Server
from tests.tiny import make_tiny_model, require_vllm

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"
PROMPTS = [[5, 9, 11, 14], [7, 3, 22, 8, 30, 2, 14]]
GREEDY = SamplingParams(max_new_tokens=6, do_sample=False)
UNPRIVILEGED = 65534  # nobody


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_listeners(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc/net/tcp and tcp6 (an IPv6
    wildcard reads '::')."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.add((socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw),
                           int(port, 16)))
    return found


def refuses(address: str, port: int) -> bool:
    """Whether a TCP connection to address:port is refused."""
    try:
        with socket.create_connection((address, port), timeout=3):
            return False
    except ConnectionRefusedError:
        return True


def non_loopback_address() -> str | None:
    """This machine's address towards the outside (TEST-NET-3: nothing is sent), None without one."""
    try:
        address = local_address_towards("203.0.113.1", 9)
    except OSError:
        return None
    return None if is_loopback(address) else address


# --- what listens where ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host,other", [("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1")])
def test_the_rendezvous_store_listens_on_the_configured_host_only(host, other):
    port = free_port()
    store = rendezvous_store(host, port, SERVER_RANK, timeout=5)
    try:
        assert [entry for entry in own_listeners() if entry[1] == port] == [(host, port)]
        assert refuses(other, port)
        outside = non_loopback_address()
        if outside is not None:
            assert refuses(outside, port)
        client = rendezvous_store(host, port, TRAINER_RANK, timeout=5)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store


def test_the_weight_group_listens_on_its_hosts_addresses_and_broadcasts():
    """Server side on 127.0.0.2 (its store and its gloo socket there), trainer side on the address it reaches
    127.0.0.2 from (127.0.0.1): no socket on every interface, none on the hostname's address by default."""
    host, port = "127.0.0.2", free_port()
    before = own_listeners()
    formed = {}

    def server_side():
        formed["server"] = WeightGroup(host, port, SERVER_RANK, 10, "s", address=host)

    thread = threading.Thread(target=server_side)
    thread.start()
    trainer = WeightGroup(host, port, TRAINER_RANK, 10, "s")
    thread.join(15)
    opened = own_listeners() - before
    assert sorted(address for address, _ in opened) == ["127.0.0.1", "127.0.0.2", "127.0.0.2"], opened
    assert (host, port) in opened
    received, sent = torch.zeros(3), torch.tensor([1.5, -2.0, 3.0])
    done = threading.Thread(target=formed["server"].broadcast, args=(received,))
    done.start()
    trainer.broadcast(sent)
    done.join(10)
    assert torch.equal(received, sent)


# --- refusing to start ------------------------------------------------------------------------------------


@pytest.mark.parametrize("host,token,allowed", [
    ("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True), ("127.0.0.2", None, True),
    ("0.0.0.0", None, False), ("::", None, False), ("192.0.2.2", None, False),
    ("no-such-host.invalid", None, False),
    ("0.0.0.0", TOKEN, True), ("192.0.2.2", TOKEN, True),
])
def test_a_non_loopback_host_needs_a_token(monkeypatch, host, token, allowed):
    from flows.serve import checked_token

    if token is None:
        monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(TOKEN_VARIABLE, token)
    if allowed:
        assert checked_token(host) == token
    else:
        with pytest.raises(ConfigurationError, match=rf"--host {host} is not a loopback address and "
                                                     rf"{TOKEN_VARIABLE} is not set"):
            checked_token(host)


def test_a_name_with_a_loopback_and_an_outside_address_is_not_loopback(monkeypatch):
    """/etc/hosts may give a name both (as some give the hostname): the server would listen outside too."""
    import grpo_core.rollout.sockets as sockets

    def resolve(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0))
                for address in ("127.0.0.1", "192.0.2.2")]

    monkeypatch.setattr(sockets.socket, "getaddrinfo", resolve)
    assert not is_loopback("both.example")


def test_an_empty_token_is_no_token(monkeypatch):
    from flows.serve import checked_token

    monkeypatch.setenv(TOKEN_VARIABLE, "")
    with pytest.raises(ConfigurationError, match=TOKEN_VARIABLE):
        checked_token("0.0.0.0")


@pytest.mark.parametrize("token", ["two words", "tab\there", "caf\u00e9"])
def test_a_token_an_http_header_cannot_carry_is_refused_naming_the_variable(monkeypatch, tiny, token):
    from flows.serve import checked_token

    monkeypatch.setenv(TOKEN_VARIABLE, token)
    with pytest.raises(ConfigurationError, match=rf"{TOKEN_VARIABLE}: the token must be printable ASCII"):
        checked_token("127.0.0.1")
    # the trainer's side, before any request
    with pytest.raises(ConfigurationError, match=TOKEN_VARIABLE) as info:
        VLLMServerBackend(*tiny, port=free_port(), timeout=1)
    assert exit_code_for(info.value) == EXIT_CONFIG


def test_flows_serve_on_every_interface_without_a_token_exits_2_before_loading_anything(tmp_path):
    """The model folder does not exist: the refusal comes first, naming the host and the variable."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
    proc = subprocess.run([sys.executable, "-m", "flows.serve", "--model", str(tmp_path / "absent"), "--host",
                           "0.0.0.0", "--port", str(free_port())], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-3000:]
    assert f"--host 0.0.0.0 is not a loopback address and {TOKEN_VARIABLE} is not set" in proc.stderr
    assert "absent" not in proc.stderr  # nothing was loaded


# --- answers that are not the protocol's --------------------------------------------------------------------


class FakeServer:
    """A real HTTP server on 127.0.0.1 that answers /health as flows.serve does and /generate with
    ``self.answer`` (bytes, sent whole)."""

    def __init__(self):
        self.answer = b"{}"
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.reply(json.dumps({"status": "ok", "dtype": "float32", "device": "cpu"}).encode())

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.reply(fake.answer)

            def reply(self, body: bytes):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("security") / "model")
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    yield server
    server.httpd.shutdown()


def completion(ids, **fields):
    return {"token_ids": ids, "finish_reason": "length", "stop_reason": None, "logprobs": None, **fields}


def answer_of(first: dict, second: dict | None = None) -> bytes:
    """/generate's answer for PROMPTS (two requests, one completion each)."""
    return json.dumps({"outputs": [[first], [second or completion([3])]]}).encode()


def test_a_well_formed_answer_is_taken(fake_server, tiny):
    """The positive control for the checks below: two prompts, greedy, one completion each."""
    model, tok = tiny
    fake_server.answer = answer_of(completion([3, 4, 5, 6, 7, 8]), completion([9] * 6))
    backend = VLLMServerBackend(model, tok, port=fake_server.port, timeout=5, place=Placement(1, 1, 2))
    batch = backend.generate(PROMPTS, 1, GREEDY)
    assert batch.completion_ids.tolist() == [[3, 4, 5, 6, 7, 8], [9] * 6]


@pytest.mark.parametrize("answer,logprobs,what", [
    (b"<html>Welcome to nginx</html>", False, r"something that is not JSON: b'<html>Welcome"),
    (b'{"outputs": [[{"token_ids": [1, 2', False, "not JSON"),
    (b'{"result": []}', False, r"no 'outputs' list"),
    (b'{"outputs": "none"}', False, r"no 'outputs' list"),
    (json.dumps({"outputs": [[completion([3])]]}).encode(), False, r"\[1\] completions for 2 requests x 1"),
    (answer_of(completion([3]), {"ids": [3]}), False, "without a 'token_ids' list"),
    (answer_of(completion([3, "VOCAB"])), False, r"token id VOCAB, outside the policy's vocabulary of VOCAB"),
    (answer_of(completion([-1])), False, r"token id -1, outside"),
    (answer_of(completion(["7"])), False, r"token id '7', outside"),
    (answer_of(completion([3.0])), False, r"token id 3.0, outside"),
    (answer_of(completion([3], finish_reason="stop", stop_reason=10**6)), False,
     r"token id 1000000, outside"),
    (answer_of(completion([3, 4]), completion([3], logprobs=[-1.0])), True,
     r"sampled-token log-probs None for 2 tokens"),
    (answer_of(completion([3, 4], logprobs=[-0.1]), completion([3], logprobs=[-1.0])), True,
     r"sampled-token log-probs \[-0.1\] for 2 tokens"),
])
def test_an_answer_that_is_not_the_protocols_is_a_permanent_error_naming_the_server(fake_server, tiny, answer,
                                                                                   logprobs, what):
    model, tok = tiny
    vocabulary = str(model.get_input_embeddings().num_embeddings)
    fake_server.answer = answer.replace(b'"VOCAB"', vocabulary.encode())
    backend = VLLMServerBackend(model, tok, port=fake_server.port, timeout=5, place=Placement(1, 1, 2),
                                return_logprobs=logprobs)
    expected = what.replace("VOCAB", vocabulary)
    with pytest.raises(VLLMServerBadAnswer, match=rf"vLLM server at 127\.0\.0\.1:{fake_server.port} answered "
                                                  rf"/generate .*{expected}") as info:
        backend.generate(PROMPTS, 1, GREEDY)
    assert exit_code_for(info.value) == EXIT_CONFIG


# --- the real server with a token ---------------------------------------------------------------------------


class TokenServer(Server):
    """``python -m flows.serve`` on 127.0.0.1 with GRPO_SERVER_TOKEN in its environment."""

    def __init__(self, model_dir: Path, log_path: Path):
        super().__init__(model_dir, log_path, max_model_length=64, env={**os.environ, TOKEN_VARIABLE: TOKEN})

    def post(self, path: str, body: dict, token: str | None = None) -> int:
        """The HTTP status of a bare POST (what curl does)."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as reply:
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    d = tmp_path_factory.mktemp("security-server")
    model_dir = make_tiny_model(d / "model", hidden_size=64, heads=2)  # head size 32: vLLM's CPU minimum
    server = TokenServer(model_dir, d / "server.log")
    yield server, model_dir
    server.stop()


def perturbed(model_dir: Path, seed: int):
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.5)
    return policy


def hf_greedy(policy, tok) -> torch.Tensor:
    return HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY).completion_ids


def test_every_socket_of_the_server_and_the_trainer_listens_on_loopback_only(served, monkeypatch):
    """After a push (the group formed and used): the server process's sockets (HTTP, the group's store and
    gloo socket, its engine's own group) and those the trainer's client opened are all on 127.0.0.1; the HTTP
    and group ports refuse 127.0.0.2 and the machine's outside address."""
    server, model_dir = served
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    tok = AutoTokenizer.from_pretrained(model_dir)
    group_port, before = free_port(), own_listeners()
    backend = VLLMServerBackend(perturbed(model_dir, seed=7), tok, port=server.port, group_port=group_port,
                                timeout=30)
    try:
        backend.generate(PROMPTS, 1, GREEDY)
        on_server, on_trainer = own_listeners(server.process.pid), own_listeners() - before
        assert {("127.0.0.1", server.port), ("127.0.0.1", group_port)} <= on_server
        assert {address for address, _ in on_server} == {"127.0.0.1"}, on_server
        assert on_trainer and {address for address, _ in on_trainer} == {"127.0.0.1"}, on_trainer
        outside = non_loopback_address()
        for port in (server.port, group_port):
            assert refuses("127.0.0.2", port) and (outside is None or refuses(outside, port))
    finally:
        backend.close()


CONTROL = [("/init_weight_group", {"port": 1, "timeout_s": 1, "session": "x"}),
           ("/update_weights", {"params": [], "version": 999}),
           ("/close_weight_group", {}),
           ("/generate", {"prompts": [[5]], "sampling": {"max_tokens": 1}, "weights_version": 0})]


def test_without_the_token_every_endpoint_is_refused_and_nothing_changes(served, monkeypatch):
    """A trainer (with the token) pushed its policy; bare POSTs to each endpoint (as any local user's curl,
    also with a wrong token) get 401, and afterwards the server serves the same version, pushed as often, and
    the trainer's group still works: its next push and round are its own policy's."""
    server, model_dir = served
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = perturbed(model_dir, seed=1)
    backend = VLLMServerBackend(policy, tok, port=server.port, group_port=free_port(), timeout=30)
    try:
        assert torch.equal(backend.generate(PROMPTS, 1, GREEDY).completion_ids, hf_greedy(policy, tok))
        before = server.health()
        for path, body in CONTROL:
            assert (server.post(path, body), server.post(path, body, token="wrong")) == (401, 401), path
        after = server.health()
        assert (after["weights_version"], after["pushes"]) == (before["weights_version"], before["pushes"])
        policy = perturbed(model_dir, seed=2)
        backend.sync_weights(policy)
        assert torch.equal(backend.generate(PROMPTS, 1, GREEDY).completion_ids, hf_greedy(policy, tok))
        assert server.health()["pushes"] == before["pushes"] + 1
    finally:
        backend.close()


def test_another_local_user_without_the_token_is_refused(served):
    """As nobody (a fork that drops to it when root): the same bare POSTs, the same 401s."""
    server, _ = served
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the standard library from here
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(UNPRIVILEGED)
                os.setuid(UNPRIVILEGED)
            codes = [server.post(path, body) for path, body in CONTROL]
            os.write(write_end, json.dumps([os.geteuid(), codes]).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        uid, codes = json.loads(pipe.read() or b"[null, null]")
    os.waitpid(pid, 0)
    assert uid == (UNPRIVILEGED if os.geteuid() == 0 else os.geteuid())
    assert codes == [401] * len(CONTROL)


def test_a_trainer_without_the_token_or_with_another_is_refused_naming_the_variable(served, monkeypatch):
    server, model_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = perturbed(model_dir, seed=3)
    pushes = server.health()["pushes"]
    for token, hint in ((None, f"the server requires a token: set {TOKEN_VARIABLE}"),
                        ("wrong", f"{TOKEN_VARIABLE} in this process's environment is not the server's")):
        if token is None:
            monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(TOKEN_VARIABLE, token)
        start = time.perf_counter()
        with pytest.raises(VLLMServerRefused, match=rf"127\.0\.0\.1:{server.port} refused /init_weight_group "
                                                    rf".*HTTP 401.*{hint}") as info:
            VLLMServerBackend(policy, tok, port=server.port, group_port=free_port(), timeout=10)
        assert exit_code_for(info.value) == EXIT_CONFIG
        assert time.perf_counter() - start < 5  # at once, not after the group's 10 s
    assert server.health()["pushes"] == pushes


def test_the_version_is_the_one_sent_with_the_weights_not_a_request_bodys(served, monkeypatch):
    """The trainer's /update_weights body is rewritten on its way to claim version 999: the server holds the
    version the trainer broadcast with the weights (1), and a round that expects version 2 is not served."""
    server, model_dir = served
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = perturbed(model_dir, seed=4)
    backend = VLLMServerBackend(policy, tok, port=server.port, group_port=free_port(), timeout=30)
    original = backend.server.request

    def forged(path, body=None, *args, **kwargs):
        if path == "/update_weights":
            body = {**body, "version": 999}
        return original(path, body, *args, **kwargs)

    backend.server.request = forged
    try:
        backend.generate(PROMPTS, 1, GREEDY)
        assert server.health()["weights_version"] == 1
        waiting = ServerConnection("127.0.0.1", server.port, timeout=10, token=TOKEN)
        start = time.perf_counter()
        with pytest.raises(VLLMServerRefused, match=r"HTTP 409: .*weights version 2 was not pushed"):
            waiting.request("/generate", {"prompts": PROMPTS, "sampling": {"max_tokens": 2},
                                          "weights_version": 2, "wait_s": 1.0}, waiting_for="a test")
        assert time.perf_counter() - start < 8
    finally:
        backend.close()


def greedy_ids(server: TokenServer) -> list:
    """The server's greedy completions of PROMPTS, asked directly (version 0: whatever it holds)."""
    body = {"prompts": PROMPTS, "sampling": {"max_tokens": 6, "temperature": 0.0}}
    reply = ServerConnection("127.0.0.1", server.port, timeout=30, token=TOKEN).request("/generate", body,
                                                                                         waiting_for="a test")
    return [[out["token_ids"] for out in outs] for outs in reply["outputs"]]


def test_weights_labelled_with_a_version_not_newer_than_the_one_held_are_refused(served, monkeypatch):
    """A push whose version is not above the held one (a stale or replayed push) is received whole, refused,
    and not loaded: the server serves the weights and version it had."""
    server, model_dir = served
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    tok = AutoTokenizer.from_pretrained(model_dir)
    backend = VLLMServerBackend(perturbed(model_dir, seed=8), tok, port=server.port, group_port=free_port(),
                                timeout=30)
    try:
        backend.generate(PROMPTS, 1, GREEDY)
        held, pushes = greedy_ids(server), server.health()["pushes"]
        backend.sync_weights(perturbed(model_dir, seed=9))
        backend.version, backend.pushed = 1, 0  # the new weights, labelled with the version already held
        with pytest.raises(VLLMServerRefused, match=r"HTTP 500: .*weights version 1 is not newer than the 1 "
                                                    r"held"):
            backend.generate(PROMPTS, 1, GREEDY)
        assert (server.health()["weights_version"], server.health()["pushes"]) == (1, pushes)
        assert greedy_ids(server) == held
    finally:
        backend.close()


def test_a_round_from_another_clients_weights_is_an_error_not_a_silent_switch(served, monkeypatch):
    """Trainer A pushed; trainer B (another client, with the token) formed its group and pushed its own
    weights; A's next round, which needs no push, is refused rather than sampled from B's weights."""
    server, model_dir = served
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    tok = AutoTokenizer.from_pretrained(model_dir)
    a_policy, b_policy = perturbed(model_dir, seed=5), perturbed(model_dir, seed=6)
    a = VLLMServerBackend(a_policy, tok, port=server.port, group_port=free_port(), timeout=30)
    a.generate(PROMPTS, 1, GREEDY)
    b = VLLMServerBackend(b_policy, tok, port=server.port, group_port=free_port(), timeout=30)
    try:
        assert torch.equal(b.generate(PROMPTS, 1, GREEDY).completion_ids, hf_greedy(b_policy, tok))
        with pytest.raises(VLLMServerError, match=rf"127\.0\.0\.1:{server.port} generated from weights this "
                                                  r"trainer did not push") as info:
            a.generate(PROMPTS, 1, GREEDY)
        assert exit_code_for(info.value) == EXIT_ERROR
    finally:
        b.close()
