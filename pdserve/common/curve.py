"""CurveZMQ on every pdserve socket, keyed by the cluster secret.

With ``--cluster-secret`` (``$PDSERVE_CLUSTER_SECRET``) every ZMQ connection of
the cluster is authenticated and encrypted with CurveZMQ (RFC 26: a Curve25519
handshake with per-connection short-term keys, then every message boxed with
XSalsa20-Poly1305). No key files travel: each process derives the same two key
pairs from the secret.

* **server pair**: every bound socket (the router's PULL, each worker's mailbox
  PULL, where ranks, peers and the router push) is a CURVE server
  (``secure_server``). A client must know the server public key to start a
  handshake at all.
* **client pair**: every connecting socket (PUSH) presents it
  (``secure_client``). Each process runs one ZAP handler per ZMQ context
  (``Gatekeeper``) that admits only this public key, so a stranger's handshake
  is refused before a single message of theirs is read.

A stranger without the secret cannot complete a handshake with any socket, so
cannot send a request, an abort, a fake token stream or a registration; nor can
they read the prompts and tokens on the wire. What this does not cover: the KV
transfer (the decode worker's TCPStore rendezvous and the gloo/NCCL data
sockets), which has no authentication of its own (docs/deploy.md).

Derivation: HKDF-SHA256 (RFC 5869) of the secret, one label per secret key, 32
bytes each (Curve25519 accepts any 32 bytes: they are clamped), Z85-encoded as
ZMQ's socket options take them; public keys by ``zmq.curve_public``.

Without a secret nothing changes (plain TCP: anyone who reaches a port may send);
``warn_unauthenticated`` says so once at a process's start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "pdserve"
_SALT = b"pdserve-curve-v1"
_SERVER_LABEL = b"pdserve curve server secret key"
_CLIENT_LABEL = b"pdserve curve client secret key"
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _hkdf_sha256(secret: bytes, label: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869), extract then expand; ``length`` <= 32 (one block)."""
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()[:length]


@dataclass(frozen=True)
class CurveKeys:
    """The cluster's two CURVE key pairs, Z85-encoded (40 bytes each), as ZMQ's options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> "CurveKeys":
        """The same keys in every process that knows ``secret`` (and nothing about it from the public keys)."""
        if not secret:
            raise ValueError("an empty cluster secret derives no keys")
        server_secret = z85.encode(_hkdf_sha256(secret.encode(), _SERVER_LABEL))
        client_secret = z85.encode(_hkdf_sha256(secret.encode(), _CLIENT_LABEL))
        return cls(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)

    def __repr__(self) -> str:  # never print the secret keys
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"


def cluster_keys(secret: str | None) -> CurveKeys | None:
    """The keys of ``secret``, or None without one (plain TCP)."""
    return CurveKeys.from_secret(secret) if secret else None


def secure_server(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``sock`` a CURVE server checked by its context's ``Gatekeeper`` (before ``bind``); None: no-op."""
    if keys is None:
        return
    sock.curve_secretkey = keys.server_secret
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``sock`` a CURVE client presenting the cluster's client key (before ``connect``); None: no-op."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class _ClusterClientsOnly:
    """ZAP credentials check: only the cluster's client public key passes."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public
        self.num_refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        self.num_refused += 1
        if self.num_refused == 1 or self.num_refused % 100 == 0:
            logger.warning("refused a CURVE handshake from an unknown client key (%d so far): a process that "
                           "does not know the cluster secret tried to connect", self.num_refused)
        return False


class Gatekeeper:
    """The ZAP handler of one ZMQ context: admits only clients presenting the cluster's client key.

    ZAP is per context (libzmq asks ``inproc://zeromq.zap.01`` of the socket's own context), so
    start one in every context that binds a ``secure_server`` socket, before it binds; ``stop``
    it before destroying the context. With ``keys`` None it does nothing.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None):
        self._auth: ThreadAuthenticator | None = None
        self._check: _ClusterClientsOnly | None = None
        if keys is None:
            return
        self._check = _ClusterClientsOnly(keys.client_public)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pdserve.zap"))
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._check)
        self._auth.start()

    @property
    def num_refused(self) -> int:
        """Handshakes refused so far for an unknown client key (a wrong server key fails before ZAP)."""
        return self._check.num_refused if self._check is not None else 0

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def warn_unauthenticated(secret: str | None, who: str) -> None:
    """At start-up without a cluster secret: say that anyone who reaches ``who``'s ZMQ ports may send to them."""
    if not secret:
        logger.warning("%s: no --cluster-secret, so the control plane is unauthenticated: anyone who can reach "
                       "this process's ZMQ ports can register, send requests and abort them. Set "
                       "--cluster-secret (or $PDSERVE_CLUSTER_SECRET) on every process, or isolate the network "
                       "(docs/deploy.md)", who)
