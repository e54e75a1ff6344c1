"""TLS end to end: a `dask scheduler/worker --preload yrdask` cluster with mutual TLS.

Certificates are made here with ``cryptography``: a cluster CA signing one certificate per role
(scheduler, worker, client), and a rogue CA with its own certificate.  The cluster is real
``dask scheduler`` / ``dask worker`` subprocesses started with ``--tls-ca-file/--tls-cert/
--tls-key``; the driver is this process.  Every yr comm must then be TLS: the job stream and
scheduler RPCs, the driver's owner server, call channels driver -> worker and worker -> worker.
A peer without a certificate the cluster's CA signed must be refused quickly, with a clear error.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from distributed.security import Security

import yrdask as yr
from conftest import STARTUP_TIMEOUT, _stop_process, _tail, wait_until

x509 = pytest.importorskip("cryptography.x509",
                           reason="the TLS tests make certificates with cryptography")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

pytestmark = pytest.mark.timeout(240)

T = 60  # seconds: explicit yr.get bound
REFUSAL_BOUND = 15  # seconds: a refused peer must hear so well before Dask's 30 s connect timeout


# --------------------------------------------------------------------------- certificates


def _name(cn: str) -> "x509.Name":
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: pathlib.Path, cert: "x509.Certificate | None" = None, key=None) -> str:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(path)


def make_pki(directory: pathlib.Path, prefix: str, roles: tuple[str, ...]) -> dict[str, str]:
    """A CA and one CA-signed certificate per role; returns {"ca", "<role>-cert", "<role>-key"}."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix} CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    files = {"ca": _write(directory / f"{prefix}-ca.pem", cert=ca)}
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(_name(f"{prefix} {role}")).issuer_name(ca.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(san, critical=False)
                .sign(ca_key, hashes.SHA256()))
        files[f"{role}-cert"] = _write(directory / f"{prefix}-{role}-cert.pem", cert=cert)
        files[f"{role}-key"] = _write(directory / f"{prefix}-{role}-key.pem", key=key)
    return files


def client_security(ca: str, cert: str, key: str) -> Security:
    return Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key,
                    require_encryption=True)


def good_security(pki: dict) -> Security:
    """The driver's Security with the client certificate the cluster's CA signed."""
    good = pki["good"]
    return client_security(good["ca"], good["client-cert"], good["client-key"])


# --------------------------------------------------------------------------- the TLS cluster


class TLSCluster:
    """A TLS scheduler and two TLS workers (one tagged ``tls_tag``), all subprocesses."""

    def __init__(self, workdir: pathlib.Path, pki: dict[str, str]) -> None:
        self.workdir, self.pki = workdir, pki
        self.procs: list[tuple[str, subprocess.Popen, pathlib.Path]] = []
        self.address = ""
        self.workers: list[str] = []  # worker addresses, once they registered with yr

    def tls_args(self, role: str) -> list[str]:
        return ["--tls-ca-file", self.pki["ca"], "--tls-cert", self.pki[f"{role}-cert"],
                "--tls-key", self.pki[f"{role}-key"]]

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:  # each worker a node of its own (YRDASK_NODE_ID)
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=self.workdir,
                                    env={**os.environ, "YRDASK_NODE_ID": f"tls-{name}"})
        self.procs.append((name, proc, log))
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {n} (rc={p.poll()})\n{_tail(log)}" for n, p, log in self.procs)

    def start(self) -> None:
        sched_file = self.workdir / "sched.json"
        sched = self._spawn("scheduler", [
            sys.executable, "-m", "distributed.cli.dask_scheduler", "--preload", "yrdask",
            "--host", "127.0.0.1", "--protocol", "tls", "--port", "0",
            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(sched_file),
            *self.tls_args("scheduler")])

        def address():
            assert sched.poll() is None, f"dask scheduler exited:\n{self.logs()}"
            try:
                return json.loads(sched_file.read_text())["address"]
            except (OSError, ValueError, KeyError):
                return None

        self.address = wait_until(address, STARTUP_TIMEOUT,
                                  lambda: f"the scheduler file\n{self.logs()}")
        assert self.address.startswith("tls://"), self.address
        for name, extra in (("tagged", ["--resources", "tls_tag=1"]), ("plain", [])):
            self._spawn(name, [
                sys.executable, "-m", "distributed.cli.dask_worker", self.address,
                "--preload", "yrdask", "--nthreads", "1", "--host", "127.0.0.1", "--name", name,
                *extra, *self.tls_args("worker")])

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            _stop_process(proc)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, dict[str, str]]:
    d = tmp_path_factory.mktemp("pki")
    return {"good": make_pki(d, "good", ("scheduler", "worker", "client")),
            "rogue": make_pki(d, "rogue", ("client",))}


@pytest.fixture(scope="module")
def tls_cluster(cluster, pki, tmp_path_factory) -> TLSCluster:
    cluster.finalize()  # the session's runtime, if a previous module left one
    tc = TLSCluster(tmp_path_factory.mktemp("tls-cluster"), pki["good"])
    try:
        tc.start()
        yr.init(yr.Config(server_address=tc.address, security=good_security(pki)))
        try:
            nodes = wait_until(lambda: len(yr.resources()) == 2 and yr.resources(), STARTUP_TIMEOUT,
                               lambda: f"2 TLS workers registered with yr\n{tc.logs()}")
            from yrdask.api.nodes import nodes_info

            tc.workers = [p for n in nodes_info() for p in n["processes"]]
        finally:
            yr.finalize()
        yield tc
    finally:
        tc.stop()


@pytest.fixture
def tls_driver(tls_cluster, pki):
    """A driver joined to the TLS cluster with the good client certificate."""
    yr.init(yr.Config(server_address=tls_cluster.address, security=good_security(pki)))
    try:
        yield tls_cluster
    finally:
        yr.finalize()


# --------------------------------------------------------------------------- remote code

TAGGED = yr.InvokeOptions(custom_resources={"tls_tag": 1})


def worker_address() -> str:
    """Inside a task: the TLS address of the worker process running it (node ids are hosts,
    docs/nodes.md; these tests check the processes' endpoints)."""
    from yrdask.runtime.context import current_runtime

    return current_runtime().address


@yr.invoke
def where():
    return worker_address()


@yr.invoke
def plus_one(x):
    return x + 1


@yr.invoke
def length(blob):
    return len(blob)


@yr.invoke
def make_blob(n):
    return b"x" * n


@yr.invoke
def nested_on_tagged(x):
    """Runs anywhere; its inner call must run on the tagged worker (worker -> worker if apart)."""
    inner = plus_one.options(TAGGED).invoke(x)
    node = where.options(TAGGED).invoke()
    big = make_blob.options(TAGGED).invoke(2 << 20)  # kept on the tagged worker, fetched here
    return yr.get(inner), yr.get(node), len(yr.get(big)), worker_address()


@yr.instance
class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        return self.n

    def node(self):
        return worker_address()


@yr.invoke
def call_instance(counter, k):
    return yr.get(counter.add.invoke(k)), worker_address()


# --------------------------------------------------------------------------- tests


def test_tasks_instances_and_nested_calls_over_tls(tls_driver):
    workers = set(tls_driver.workers)
    assert all(w.startswith("tls://") for w in workers), workers
    assert yr.get(plus_one.invoke(1), T) == 2
    # Worker -> worker: the outer task on the plain worker calls into the tagged one.
    plain_only = yr.InvokeOptions(cpu=1000)  # the tagged worker's CPU is taken below
    # a light instance (pinned): node() reads the address of the worker it runs in
    counter = Counter.options(yr.InvokeOptions(cpu=1000, custom_resources={"tls_tag": 1},
                                               light=True)).invoke()
    tagged_node = yr.get(counter.node.invoke(), T)
    assert tagged_node in workers
    assert [yr.get(counter.add.invoke(1), T) for _ in range(3)] == [1, 2, 3]
    got = yr.get(call_instance.options(plain_only).invoke(counter, 10), T)
    assert got[0] == 13 and got[1] in workers - {tagged_node}, (got, tagged_node)
    counter.terminate(is_sync=True)  # frees the tagged worker's CPU
    inner, inner_node, big_len, outer_node = yr.get(
        nested_on_tagged.options(plain_only).invoke(41), T)
    assert (inner, big_len) == (42, 2 << 20)
    assert inner_node == tagged_node and outer_node in workers
    # Large objects the driver owns are fetched by workers from its owner server (TLS too).
    blob = yr.put(b"y" * (3 << 20))
    assert yr.get(length.invoke(blob), T) == 3 << 20
    assert len(yr.get(make_blob.invoke(1 << 20), T)) == 1 << 20
    # The driver's own endpoint is a TLS listener as well.
    assert yr.get_node_id().startswith("tls://") and yr.get_node_id() not in workers


def test_a_process_instance_serves_its_callers_over_tls(tls_driver):
    """A process instance's own endpoint, where its callers send their calls, listens with
    TLS, on its worker's certificates (given on the worker's command line only)."""
    from yrdask import protocol as P
    from yrdask.runtime.context import current_runtime

    h = Counter.options(yr.InvokeOptions(cpu=100, memory=10, light=False)).invoke()
    assert [yr.get(h.add.invoke(1), T) for _ in range(2)] == [1, 2]
    rt = current_runtime()
    address = rt.run_sync(rt.connector.request(P.LocateInstance(h.instance_id)), T)[1]
    assert address.startswith("tls://") and address not in tls_driver.workers, address
    h.terminate(is_sync=True)


def test_yr_config_tls_fields(tls_cluster, pki):
    """openYuanrong's own fields (enable_tls + three paths) join the TLS cluster."""
    good = pki["good"]
    yr.init(yr.Config(server_address=tls_cluster.address, enable_tls=True,
                      verify_file_path=good["ca"], certificate_file_path=good["client-cert"],
                      private_key_path=good["client-key"]))
    try:
        assert yr.get(where.invoke(), T) in tls_cluster.workers
    finally:
        yr.finalize()


def test_dask_tls_config_and_bare_address(tls_cluster, pki):
    """With no security in Config, Dask's `distributed.comm.tls` config is used; a bare
    host:port address then means tls://."""
    import dask

    good = pki["good"]
    bare = tls_cluster.address[len("tls://"):]
    with dask.config.set({"distributed.comm.tls.ca-file": good["ca"],
                          "distributed.comm.tls.client.cert": good["client-cert"],
                          "distributed.comm.tls.client.key": good["client-key"]}):
        info = yr.init(yr.Config(server_address=bare))
        try:
            assert info.scheduler_address == tls_cluster.address
            assert yr.get(where.options(TAGGED).invoke(), T) in tls_cluster.workers
        finally:
            yr.finalize()


@pytest.mark.parametrize("which", ["rogue CA and certificate", "trusted CA, rogue certificate"])
def test_driver_with_untrusted_certificate_is_refused(tls_cluster, pki, which):
    good, rogue = pki["good"], pki["rogue"]
    ca = rogue["ca"] if which.startswith("rogue CA") else good["ca"]
    sec = client_security(ca, rogue["client-cert"], rogue["client-key"])
    start = time.monotonic()
    with pytest.raises(yr.YRRuntimeError) as info:
        yr.init(yr.Config(server_address=tls_cluster.address, security=sec))
    assert time.monotonic() - start < REFUSAL_BOUND
    message = str(info.value)
    assert tls_cluster.address in message and "cannot join" in message, message
    assert not yr.is_initialized()


def test_peers_without_valid_certificates_cannot_reach_scheduler_or_workers(tls_cluster, pki):
    """Anybody who can open a yr comm can run code: a listener must refuse untrusted peers."""
    from distributed.comm import connect

    rogue = pki["rogue"]
    bad = client_security(rogue["ca"], rogue["client-cert"], rogue["client-key"])
    targets = [tls_cluster.address, *tls_cluster.workers]

    async def attempt(address: str, **kwargs) -> BaseException | None:
        try:
            comm = await connect(address, timeout=REFUSAL_BOUND, **kwargs)
        except Exception as e:  # noqa: BLE001 - any refusal will do; what matters is that it fails
            return e
        await comm.close()
        return None

    async def main() -> list:
        results = []
        for address in targets:
            rogue_args = bad.get_connection_args("client")
            results.append((address, "rogue cert", await attempt(address, **rogue_args)))
            plain = address.replace("tls://", "tcp://")
            results.append((address, "plain tcp", await attempt(plain)))
        return results

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < REFUSAL_BOUND * 2
    accepted = [(a, how) for a, how, err in results if err is None]
    assert not accepted, f"untrusted peers were accepted: {accepted}"
    # ... and the cluster still serves trusted drivers afterwards.
    yr.init(yr.Config(server_address=tls_cluster.address, security=good_security(pki)))
    try:
        assert yr.get(plus_one.invoke(1), T) == 2
    finally:
        yr.finalize()


def test_bad_tls_settings_fail_at_init_naming_the_problem(tls_cluster, pki, tmp_path):
    good = pki["good"]
    missing = str(tmp_path / "no-such-ca.pem")
    cases = [
        (yr.Config(server_address=tls_cluster.address,
                   security=client_security(missing, good["client-cert"], good["client-key"])),
         missing),
        (yr.Config(server_address=tls_cluster.address, enable_tls=True,
                   verify_file_path=good["ca"], certificate_file_path=good["client-cert"],
                   private_key_path=missing), "Config.private_key_path"),
        (yr.Config(server_address=tls_cluster.address, enable_tls=True), "Config.verify_file_path"),
        (yr.Config(server_address=tls_cluster.address,  # a key that is not the certificate's
                   security=client_security(good["ca"], good["client-cert"], good["worker-key"])),
         "do not load"),
        (yr.Config(server_address=tls_cluster.address), "no TLS certificates"),
        (yr.Config(server_address=tls_cluster.address.replace("tls://", "tcp://"),
                   security=client_security(good["ca"], good["client-cert"], good["client-key"])),
         "require encryption"),
    ]
    for conf, needle in cases:
        with pytest.raises(yr.YRValueError) as info:
            yr.init(conf)
        assert needle in str(info.value), (needle, str(info.value))
        assert not yr.is_initialized()


def test_embedded_cluster_with_security_uses_tls(cluster):
    """`yr.init(Config(security=...))` with no address: the embedded cluster runs on TLS too."""
    pytest.importorskip("cryptography")
    cluster.finalize()
    info = yr.init(yr.Config(num_cpus=1, security=Security.temporary()))
    try:
        assert info.scheduler_address.startswith("tls://")
        node = yr.get(where.invoke(), T)
        assert node.startswith("tls://") and len(yr.resources()) == 1
        assert yr.get(length.invoke(yr.put(b"z" * (1 << 20))), T) == 1 << 20
    finally:
        yr.finalize()
