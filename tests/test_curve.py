"""CurveZMQ under a cluster secret (``pdserve.common.curve``): keys, and who a mailbox admits.

Real sockets on loopback; the whole cluster with a secret, and forged messages
sent to it, is in test_cluster.py.
"""

from __future__ import annotations

import time

import zmq

from pdserve.common.curve import CurveKeys, cluster_keys
from pdserve.common.protocol import AbortRequest
from pdserve.common.transport import Mailbox, PushSocket, encode

HOST = "127.0.0.1"


def test_keys_come_from_the_secret_alone():
    keys = CurveKeys.from_secret("s3cret")
    assert keys == CurveKeys.from_secret("s3cret")  # every process derives the same
    other = CurveKeys.from_secret("s3cret2")
    assert {keys.server_secret, keys.client_secret}.isdisjoint({other.server_secret, other.client_secret})
    assert keys.server_secret != keys.client_secret
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert all(len(k) == 40 for k in (keys.server_public, keys.server_secret, keys.client_public,
                                      keys.client_secret))
    assert "secret" not in repr(keys).replace("server_public", "").replace("client_public", "")
    assert cluster_keys(None) is None and cluster_keys("") is None


def _stranger(ctx: zmq.Context, addr: str, *, server_public: bytes | None = None,
              client_pair: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    """A PUSH socket of someone who is not in the cluster (plain, or with keys of their own)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if server_public is not None:
        public, secret = client_pair or zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    sock.connect(addr)
    return sock


def test_only_holders_of_the_secret_reach_a_mailbox():
    keys = cluster_keys("s3cret")
    wrong = cluster_keys("not-the-secret")
    box = Mailbox(HOST, keys=keys)
    ctx = zmq.Context()
    member = PushSocket(box.address, keys=keys)
    try:
        strangers = [
            _stranger(ctx, box.address),  # plain TCP: refused (mechanism mismatch)
            _stranger(ctx, box.address, server_public=wrong.server_public,  # another cluster's keys
                      client_pair=(wrong.client_public, wrong.client_secret)),
            _stranger(ctx, box.address, server_public=keys.server_public),  # knows the server key only
        ]
        for i, sock in enumerate(strangers):
            sock.send_multipart(encode(AbortRequest(request_id=f"forged-{i}")))
        time.sleep(0.5)
        member.send(AbortRequest(request_id="member"))
        got = box.get(timeout=5)
        assert isinstance(got, AbortRequest) and got.request_id == "member"
        time.sleep(0.5)
        assert box.get_nowait() is None  # nothing of the strangers' arrived, before or after
        assert box._gatekeeper.num_refused >= 1  # the stranger with the server key was refused by ZAP
    finally:
        member.close()
        ctx.destroy(linger=0)
        box.close()


def test_mailboxes_with_one_secret_talk_both_ways():
    keys = cluster_keys("s3cret")
    a, b = Mailbox(HOST, keys=keys), Mailbox(HOST, keys=keys)
    try:
        a.put(b.address, AbortRequest(request_id="to-b"))
        b.put(a.address, AbortRequest(request_id="to-a"))
        assert b.get(timeout=5).request_id == "to-b"
        assert a.get(timeout=5).request_id == "to-a"
    finally:
        a.close()
        b.close()


def test_a_mailbox_with_another_secret_is_not_heard():
    box, outsider = Mailbox(HOST, keys=cluster_keys("s3cret")), Mailbox(HOST, keys=cluster_keys("other"))
    plain = Mailbox(HOST)
    try:
        outsider.put(box.address, AbortRequest(request_id="wrong-secret"))
        plain.put(box.address, AbortRequest(request_id="no-secret"))
        assert box.get(timeout=1.0) is None
    finally:
        for m in (box, outsider, plain):
            m.close()
