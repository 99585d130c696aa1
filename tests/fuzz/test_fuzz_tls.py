"""The fuzzer with TLS on (issue 11): a parameter server under mutual TLS gets generated and raw
requests from a worker's certificate (whose stamps name other nodes, mostly) and from a certificate of
the job's CA that names no role. After every case: a proper status (never UNKNOWN or INTERNAL), the
server alive and SERVING, the stored weights unchanged unless the call was accepted; the stranger is
UNAUTHENTICATED every time, whatever its bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import MethodDescriptor
from pshard.common.job import JobConfig
from pshard.common.rpc.options import channel_options
from pshard.common.security.ca import ensure, issue
from pshard.common.security.credentials import SecurityConfig
from pshard.common.security.identity import Identity

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.fuzz.harness import (
    NO_HANG_S,
    WAITING_CALL_S,
    assert_proper_status,
    assert_serving,
    call,
    run_cases,
)
from tests.fuzz.strategies import raw_bytes
from tests.service.conftest import ServerSettings, ServerThread, Wire, start_server_thread

PS = pb.DESCRIPTOR.services_by_name["ParameterServerService"]
UNARY = [m for m in PS.methods if not m.client_streaming]
WAITING = {"Pull", "PushPull", "Checkpoint", "SaveCheckpointPart", "RestoreCheckpoint"}
CASES = 40  # per method and client: the plain fuzzer covers the handlers; this covers the gate
MODEL = {"w": np.arange(6, dtype=np.float32)}


@dataclass
class SecureServer:
    server: ServerThread
    chief: grpc.Channel
    worker: grpc.Channel
    stranger: grpc.Channel

    def stored(self) -> bytes:
        reply = pb_grpc.ParameterServerServiceStub(self.chief).Pull(
            pb.PullRequest(stamp=Wire.stamp("chief-0", 0), slices=[Wire.slice_id("w")]), timeout=NO_HANG_S)
        return bytes(reply.slices[0].tensor.data)


def _no_role(directory: Path) -> SecurityConfig:
    """A certificate of the job's CA whose URI names no pshard role."""
    files = issue(directory, Identity("worker", "x"), name="no-role")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    old = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(ca.subject)
            .public_key(old.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(old.not_valid_before_utc).not_valid_after(old.not_valid_after_utc)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("spiffe://other/x")]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files.security()


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureServer]:
    pki = tmp_path_factory.mktemp("fuzz-pki")
    made = ensure(pki, [Identity("ps", "ps-0"), Identity("chief", "chief-0"), Identity("worker", "worker-1")])
    settings = ServerSettings(default_job=JobConfig(mode="async"), pull_timeout_s=0.1,
                              checkpoint_dir=str(tmp_path_factory.mktemp("fuzz-tls-checkpoints")))
    server = start_server_thread(settings, security=made[Identity("ps", "ps-0")].security())
    options = channel_options()
    chief = made[Identity("chief", "chief-0")].security("chief", "chief-0").channel(server.address, options)
    worker_files = made[Identity("worker", "worker-1")]
    worker = worker_files.security("worker", "worker-1").channel(server.address, options)
    stranger = _no_role(pki).channel(server.address, options)
    try:
        pb_grpc.ParameterServerServiceStub(chief).Declare(
            pb.DeclareRequest(slices=[Wire.tensor("w", MODEL["w"])]), timeout=NO_HANG_S)
        yield SecureServer(server, chief, worker, stranger)
    finally:
        for channel in (chief, worker, stranger):
            channel.close()
        server.stop(grace_s=0.2)


def _check(live: SecureServer, channel: grpc.Channel, method: MethodDescriptor, payload: bytes,
           *, stranger: bool) -> None:
    before = live.stored()
    waits = method.name in WAITING
    outcome = call(channel, method, payload, WAITING_CALL_S if waits else NO_HANG_S)
    what = f"{method.name}({payload[:40]!r})"
    if stranger:
        assert outcome.code is grpc.StatusCode.UNAUTHENTICATED, (what, outcome)
    assert_proper_status(outcome, what, waits)
    assert live.server.thread.is_alive(), f"after {what}: the server's thread ended"
    assert_serving(live.chief, "", what)
    if outcome.refused:
        assert live.stored() == before, f"{what} was refused ({outcome.code.name}) but changed the weights"


@pytest.mark.parametrize("method", UNARY, ids=lambda m: m.name)
def test_a_workers_raw_requests_are_answered_properly_under_tls(secure: SecureServer,
                                                                 method: MethodDescriptor) -> None:
    # Raw bytes, mutations of a valid Pull among them: `messages` cannot build every newer request type.
    seeds = [pb.PullRequest(stamp=Wire.stamp("worker-1", 0), slices=[Wire.slice_id("w")])]
    run_cases(raw_bytes(seeds), lambda raw: _check(secure, secure.worker, method, raw, stranger=False),
              CASES, f"tls-raw-{method.name}")


@pytest.mark.parametrize("method", UNARY, ids=lambda m: m.name)
def test_a_stranger_is_unauthenticated_whatever_it_sends(secure: SecureServer,
                                                         method: MethodDescriptor) -> None:
    run_cases(raw_bytes([]), lambda raw: _check(secure, secure.stranger, method, raw, stranger=True),
              CASES, f"tls-stranger-{method.name}")
