"""``pdserve scale``: set the pools' target sizes of a running cluster through the router's admin API.

The router drains a shrinking pool's surplus itself; ``pdserve up`` and
``pdserve up --ray`` start workers for a growing one (``ClusterLauncher.reconcile``).
With ``wait`` the call returns once every targeted pool serves exactly its
target and nothing drains.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


def admin_request(router: str, path: str, api_key: str | None, body: dict | None = None) -> dict:
    """GET ``path`` from the router (POST ``body`` as JSON if given), with the API key; the JSON answer.

    Raises:
        RuntimeError: the router answered an error (its OpenAI-style message included).
        OSError: the router cannot be reached.
    """
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{router.rstrip('/')}{path}", data=data, headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:  # the router's OpenAI-style error body says why
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise RuntimeError(f"{e.code} from the router: {message}") from None


def pools_settled(pools: dict, targets: dict[str, int]) -> bool:
    """Whether every pool in ``targets`` serves exactly its target and has no worker draining."""
    return all(pools[role]["num_serving"] == n and pools[role]["num_draining"] == 0 for role, n in targets.items())


def scale_pools(router: str, prefill: int | None = None, decode: int | None = None, api_key: str | None = None,
                wait: bool = False, timeout_s: float = 300.0, poll_s: float = 0.5) -> dict:
    """Set the targets (``None``: leave that pool's) and return ``GET /admin/pools`` afterwards.

    Raises:
        RuntimeError: the router refused (e.g. 400 for ``decode < 1``, 401 without the API key).
        TimeoutError: with ``wait``, the pools did not settle within ``timeout_s``.
        OSError: the router cannot be reached.
    """
    targets = {role: n for role, n in (("prefill", prefill), ("decode", decode)) if n is not None}
    if not targets:
        return admin_request(router, "/admin/pools", api_key)
    pools = admin_request(router, "/admin/scale", api_key, targets)["pools"]
    deadline = time.monotonic() + timeout_s
    while wait and not pools_settled(pools, targets):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pools not at their targets after {timeout_s:.0f} s: " + ", ".join(
                f"{role} {pools[role]['num_serving']} serving, {pools[role]['num_draining']} draining"
                for role in targets))
        time.sleep(poll_s)
        pools = admin_request(router, "/admin/pools", api_key)
    return pools


def print_pools(pools: dict) -> None:
    """One line per pool and one per worker."""
    for role in ("prefill", "decode"):
        pool = pools[role]
        target = "unset" if pool["desired"] is None else pool["desired"]
        print(f"{role}: {pool['num_serving']} serving, {pool['num_draining']} draining (target {target})")
        for w in pool["workers"]:
            print(f"  {w['id']:<24} {w['state']:<9} {w['address']:<28} running {w['num_running']:>3}  "
                  f"waiting {w['num_waiting']:>3}  outstanding {w['num_outstanding']:>3}")
