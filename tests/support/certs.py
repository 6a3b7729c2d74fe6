"""Test certificates, made with the openssl command line (installed by .ci/run).

`make_pki(directory)` writes a CA, a server certificate it signed (for
127.0.0.1 and localhost), a client certificate it signed, and a second,
unrelated CA with a client certificate of its own (the "wrong" client).
EC P-256 keys: fast to make, accepted by gRPC's BoringSSL and Python's ssl.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

DAYS = "2"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _key(path: Path) -> Path:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", path)
    return path


def _ca(directory: Path, name: str) -> tuple[Path, Path]:
    key = _key(directory / f"{name}.key")
    cert = directory / f"{name}.pem"
    _openssl(
        *("req", "-x509", "-new", "-key", key, "-sha256", "-days", DAYS),
        *("-subj", f"/CN={name}", "-out", cert),
        *("-addext", "basicConstraints=critical,CA:TRUE"),
        *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
    )
    return cert, key


def _leaf(directory: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    key = _key(directory / f"{name}.key")
    request = directory / f"{name}.csr"
    cert = directory / f"{name}.pem"
    ext = directory / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", request)
    _openssl(
        *("x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial"),
        *("-days", DAYS, "-sha256", "-extfile", ext, "-out", cert),
    )
    return cert, key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "test-ca")
    server = _leaf(
        directory,
        "server",
        ca,
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    client = _leaf(
        directory, "client", ca, "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"
    )
    rogue_ca = _ca(directory, "rogue-ca")
    rogue = _leaf(
        directory, "rogue", rogue_ca, "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"
    )
    return Pki(ca[0], *server, *client, rogue_ca[0], *rogue)
