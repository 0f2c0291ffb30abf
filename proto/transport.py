"""CURVE for the tcp:// step channels: the deployment's key pair on disk, and the ZAP handler that admits only its holders."""

from __future__ import annotations

import hmac
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from proto.errors import ValidationError

logger = logging.getLogger(__name__)

KEY_NAME = "conveyor"
PUBLIC_KEY_FILE = f"{KEY_NAME}.key"  # the public key alone (zmq.auth's certificate format)
SECRET_KEY_FILE = f"{KEY_NAME}.key_secret"  # public and secret key: the one file every node needs
Z85_KEY_LEN = 40  # a 32-byte CURVE key as Z85 text


@dataclass(frozen=True)
class TransportKeys:
    """One deployment's CURVE key pair (Z85). Every node holds the same pair: the scheduler is the
    CURVE server with it, workers are clients with it, and a client is admitted only if its public
    key is this one, which completing the handshake proves it holds the secret key of."""

    public_key: bytes
    secret_key: bytes = field(repr=False)


def write_key_pair(directory: str | Path) -> Path:
    """A fresh key pair in `directory` (created 0700; the secret file 0600); never overwrites one.
    Returns the secret file's path."""
    directory = Path(directory)
    secret_path, public_path = directory / SECRET_KEY_FILE, directory / PUBLIC_KEY_FILE
    if secret_path.exists() or public_path.exists():
        raise ValidationError(f"{directory} already holds a key pair ({SECRET_KEY_FILE}); remove it "
                              "first or choose another directory", "transport_keys_dir")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    previous = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(directory, KEY_NAME)
    finally:
        os.umask(previous)
    public_path.chmod(0o644)
    return secret_path


def load_transport_keys(directory: str | Path) -> TransportKeys:
    """The pair in `directory`/conveyor.key_secret, checked; ValidationError says what is wrong."""
    path = Path(directory) / SECRET_KEY_FILE
    hint = "create the deployment's key pair once with `conveyor keygen DIR` and give every node a copy"
    try:
        public_key, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValidationError(f"--transport-keys {directory}: cannot read {path} ({exc}); {hint}",
                              "transport_keys_dir") from exc
    if secret_key is None or len(secret_key) != Z85_KEY_LEN or len(public_key) != Z85_KEY_LEN:
        raise ValidationError(f"--transport-keys {directory}: {path} does not hold a CURVE key pair "
                              f"(a public-key and a secret-key of {Z85_KEY_LEN} Z85 characters); {hint}",
                              "transport_keys_dir")
    try:
        matches = zmq.curve_public(secret_key) == public_key
    except (ValueError, zmq.ZMQError) as exc:
        raise ValidationError(f"--transport-keys {directory}: {path} holds an invalid secret key "
                              f"({exc}); {hint}", "transport_keys_dir") from exc
    if not matches:
        raise ValidationError(f"--transport-keys {directory}: in {path} the public key is not the "
                              f"secret key's; {hint}", "transport_keys_dir")
    return TransportKeys(public_key, secret_key)


def make_curve_server(sock: zmq.Socket, keys: TransportKeys) -> None:
    """Before bind: handshakes on `sock` need CURVE, and the context's KeyGuard vets each client."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True


def make_curve_client(sock: zmq.Socket, keys: TransportKeys) -> None:
    """Before connect: `sock` talks only to a server holding the deployment's key pair."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.public_key


class KeyGuard:
    """The ZAP handler of one context; start it before binding a CURVE server socket there (with
    no handler libzmq admits any client key). It admits clients whose public key is the
    deployment's and refuses, logs and counts every other one: their frames never reach a socket."""

    def __init__(self, context: zmq.Context, keys: TransportKeys) -> None:
        self.keys = keys
        self.num_refused = 0
        self._lock = threading.Lock()
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.configure_curve_callback("*", self)
        self._authenticator.start()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """zmq.auth's credentials-provider hook, on the authenticator's thread (key in Z85)."""
        if hmac.compare_digest(client_key, self.keys.public_key):
            return True
        with self._lock:
            self.num_refused += 1
            num_refused = self.num_refused
        logger.warning("refused a step-channel peer: its CURVE key %s is not this deployment's "
                       "(%d refused so far)", client_key.decode(errors="replace"), num_refused)
        return False

    def stop(self) -> None:
        """Before the context is destroyed: the handler's thread owns a socket in it."""
        self._authenticator.stop()
