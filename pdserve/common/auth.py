"""Who may use the cluster: the HTTP API key and the workers' shared secret.

* ``--api-key`` (or ``PDSERVE_API_KEY``): the router answers 401 on ``/v1/*``
  unless the request carries ``Authorization: Bearer KEY`` (as vLLM and OpenAI
  do); ``/health`` and ``/metrics`` stay open.
* ``--cluster-secret`` (or ``PDSERVE_CLUSTER_SECRET``): a worker's
  ``RegisterWorker`` carries ``registration_token``, an HMAC-SHA256 of its id,
  role and input address under the secret. The router admits only registrations
  whose token matches, so a stranger on the network cannot join a pool and be
  sent prompts, and a token seen on the wire cannot register another address.
  The same secret keys CurveZMQ on every socket (``pdserve.common.curve``), so
  a stranger's messages do not reach any socket's reader in the first place.
"""

from __future__ import annotations

import hashlib
import hmac
import os

API_KEY_ENV = "PDSERVE_API_KEY"
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"


def from_env(value: str | None, env: str) -> str | None:
    """``value`` if given, else the environment variable ``env``; empty means unset."""
    value = value if value is not None else os.environ.get(env)
    return value or None


def registration_token(secret: str, worker_id: str, role: int, input_addr: str) -> str:
    """Hex HMAC-SHA256 under ``secret`` of what the registration claims (id, role, address)."""
    message = f"{worker_id}|{int(role)}|{input_addr}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def token_matches(secret: str, token: str | None, worker_id: str, role: int, input_addr: str) -> bool:
    """Constant-time check of a registration's token."""
    if not token:
        return False
    return hmac.compare_digest(token, registration_token(secret, worker_id, role, input_addr))


def bearer_matches(api_key: str, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant-time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())
