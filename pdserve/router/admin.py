"""The router's admin endpoints: the pools, their target sizes, draining a worker.

    GET  /admin/pools                     each pool's target size and workers (state, load)
    POST /admin/scale                     {"prefill": N, "decode": M}: set the targets (either may be left out)
    POST /admin/workers/{worker_id}/drain stop routing to one worker; it finishes what it holds, then exits

With ``--api-key`` these need ``Authorization: Bearer KEY``, as ``/v1/*`` does.

A router tier keeps the targets in one place (``--pool-owner``): the designated
router (``pdserve up --num-routers N``: router-0) keeps them as a lone router
does, and every other router forwards ``/admin/pools`` and ``/admin/scale`` to
it, so whichever router a client (or the launcher) reaches, it sees and sets the
same targets. With ``--pool-owner none`` (Kubernetes) the pool sizes are the
Deployments' replicas and ``/admin/scale`` answers 409. Draining one worker is
any router's to do: the worker then tells every router it is leaving.

Shrinking a pool drains its surplus workers (``WorkerRegistry.surplus``): they
get nothing new, finish their requests and exit, so no request fails. Growing
it is the launcher's part (``pdserve up`` and ``pdserve up --ray`` poll
``/admin/pools`` and start workers up to the target); a cluster without a
launcher (hand-joined workers, Kubernetes) grows by starting workers (or
``kubectl scale``), and ``/admin/pools`` shows the gap.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.common.protocol import WorkerRole
from pdserve.router.engine import RouterEngine
from pdserve.router.errors import APIError
from pdserve.cluster.scale import admin_request


class ScaleRequest(BaseModel):
    """Target pool sizes; a pool left out keeps its target (``true`` and ``"3"`` are not pool sizes, as the
    schema's integer says; ``3.0`` is 3)."""

    model_config = ConfigDict(extra="forbid")

    prefill: int | None = Field(default=None, ge=0, le=1024,
                                description="prefill workers (0: decode workers prefill locally)")
    decode: int | None = Field(default=None, ge=1, le=1024, description="decode workers (at least 1)")

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _numbers_only(cls, value):
        if isinstance(value, (bool, str)):
            raise ValueError(f"must be a number of workers, not a {type(value).__name__}")
        return value


async def _forward(owner: str, path: str, api_key: str | None, body: dict | None = None) -> dict:
    """``path`` answered by the router that owns the pools' targets (a 503 if it cannot be reached)."""
    try:
        return await asyncio.to_thread(admin_request, owner, path, api_key, body)
    except RuntimeError as e:  # the owner answered an error
        raise APIError(502, f"the router that keeps the pools' targets ({owner}) said: {e}") from None
    except (OSError, ValueError) as e:
        raise APIError(503, f"the router that keeps the pools' targets ({owner}) cannot be reached: {e}; "
                            f"retry once it is back") from None


def add_admin_routes(app: FastAPI, engine: RouterEngine, pool_owner: str | None = None,
                     api_key: str | None = None) -> None:
    """Register ``/admin/*`` on ``app`` (the API-key middleware covers them).

    ``pool_owner``: None, this router keeps the targets; a URL, forward the pools' endpoints there
    (with ``api_key``); ``"none"``, the targets are kept outside pdserve (``/admin/scale``: 409).
    """
    registry = engine.registry
    forward_to = pool_owner if pool_owner not in (None, "none") else None

    @app.get("/admin/pools")
    async def pools():
        """Each pool: target size (null until scaled), serving and draining counts, workers."""
        if forward_to is not None:
            return await _forward(forward_to, "/admin/pools", api_key)
        return registry.pools()

    @app.post("/admin/scale")
    async def scale(body: ScaleRequest):
        """Set the pools' target sizes; the surplus of a shrinking pool is drained (listed in ``draining``)."""
        if pool_owner == "none":
            raise APIError(409, "this router tier keeps no pool targets (--pool-owner none): the pools' sizes are "
                                "the deployment's, e.g. kubectl scale deploy/pdserve-decode --replicas N")
        if forward_to is not None:
            return await _forward(forward_to, "/admin/scale", api_key, body.model_dump(exclude_none=True))
        drained = []
        for role, target in ((WorkerRole.PREFILL, body.prefill), (WorkerRole.DECODE, body.decode)):
            if target is not None:
                drained += [w.worker_id for w in engine.scale(role, target)]
        return {"draining": drained, "pools": registry.pools()}

    @app.post("/admin/workers/{worker_id}/drain")
    async def drain(worker_id: str):
        """Drain one worker (404 if the router does not know it)."""
        worker = engine.drain(worker_id, "drained by an admin request")
        if worker is None:
            raise APIError(404, f"no worker {worker_id!r} is registered", param="worker_id")
        return {"id": worker_id, "state": worker.state, "num_outstanding": worker.num_outstanding}
