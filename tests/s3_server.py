"""A real S3-compatible server for the tests: moto's server (``moto[server]``, pip-installed, nothing
downloaded at run time) on the loopback address, over HTTPS with a CA made for the test, and with
moto's request authentication on, so wrong credentials are refused as a store would refuse them.

How far it is from a production store: moto implements S3's HTTP API (signatures, multipart uploads,
ranged GETs, the error codes) in one Python process, in memory. It has no durability, no
replication, no consistency lag, no throttling and little concurrency; throughput numbers from it
say nothing about a real store. What it does test is the protocol: credentials, the endpoint key,
TLS trust, missing buckets and keys, and a store that goes away.

HTTPS because LitData's fast chunk reader (obstore) refuses plain-HTTP endpoints unless told, which
LitData does not do: a CA file named by ``AWS_CA_BUNDLE`` (boto3) and ``SSL_CERT_FILE`` (obstore)
makes both trust the server, as a company's private CA would.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUCKET = "training-data"
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    ca_file: Path
    access_key: str
    secret_key: str
    process: subprocess.Popen[bytes]

    def env(self, **overrides: str) -> dict[str, str]:
        """The standard AWS settings that reach this server with the test user's credentials."""
        values = {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                  "AWS_DEFAULT_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint,
                  "AWS_CA_BUNDLE": str(self.ca_file), "SSL_CERT_FILE": str(self.ca_file)}
        values.update(overrides)
        return values

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, verify=str(self.ca_file),
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it (a self-signed server certificate
    is refused by rustls as a CA used as an end entity)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trainer test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
              .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(folder: Path) -> S3Server:
    """The server, a user with S3 rights and its keys, and the bucket ``BUCKET``."""
    import boto3

    from filelock import FileLock

    ca, cert, key = _certificates(folder)
    env = dict(os.environ)
    # The first 4 requests go unauthenticated (the user, its policy, its key, the bucket); every
    # later one must be signed with a key moto knows.
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
    # A free port is picked, released and then bound by the server: another test process (make test
    # runs two) starting a server meanwhile could pick the same one, so one server starts at a time.
    with FileLock(Path(tempfile.gettempdir()) / "trainer-tests-s3-port.lock"):
        port = _free_port()
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port), "-c",
                                    str(cert), "-k", str(key)], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
    endpoint = f"https://127.0.0.1:{port}"
    setup = dict(endpoint_url=endpoint, region_name=REGION, verify=str(ca), aws_access_key_id="setup",
                 aws_secret_access_key="setup")
    iam = boto3.client("iam", **setup)
    iam.create_user(UserName="trainer")
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=(
        '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'))
    keys = iam.create_access_key(UserName="trainer")["AccessKey"]
    boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
    return S3Server(endpoint, ca, keys["AccessKeyId"], keys["SecretAccessKey"], process)
