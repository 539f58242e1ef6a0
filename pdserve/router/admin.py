"""The router's admin endpoints: the pools, their target sizes, draining a worker.

    GET  /admin/pools                     each pool's target size and workers (state, load)
    POST /admin/scale                     {"prefill": N, "decode": M}: set the targets (either may be left out)
    POST /admin/workers/{worker_id}/drain stop routing to one worker; it finishes what it holds, then exits

With ``--api-key`` these need ``Authorization: Bearer KEY``, as ``/v1/*`` does.

Shrinking a pool drains its surplus workers (``WorkerRegistry.surplus``): they
get nothing new, finish their requests and exit, so no request fails. Growing
it is the launcher's part (``pdserve up`` and ``pdserve up --ray`` poll
``/admin/pools`` and start workers up to the target); a cluster without a
launcher (hand-joined workers, Kubernetes) grows by starting workers (or
``kubectl scale``), and ``/admin/pools`` shows the gap.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.common.protocol import WorkerRole
from pdserve.router.engine import RouterEngine
from pdserve.router.errors import APIError


class ScaleRequest(BaseModel):
    """Target pool sizes; a pool left out keeps its target (``true`` is not a pool size; ``3.0`` is 3)."""

    model_config = ConfigDict(extra="forbid")

    prefill: int | None = Field(default=None, ge=0, le=1024,
                                description="prefill workers (0: decode workers prefill locally)")
    decode: int | None = Field(default=None, ge=1, le=1024, description="decode workers (at least 1)")

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _no_booleans(cls, value):
        if isinstance(value, bool):
            raise ValueError("must be a number of workers, not a boolean")
        return value


def add_admin_routes(app: FastAPI, engine: RouterEngine) -> None:
    """Register ``/admin/*`` on ``app`` (the API-key middleware covers them)."""
    registry = engine.registry

    @app.get("/admin/pools")
    async def pools():
        """Each pool: target size (null until scaled), serving and draining counts, workers."""
        return registry.pools()

    @app.post("/admin/scale")
    async def scale(body: ScaleRequest):
        """Set the pools' target sizes; the surplus of a shrinking pool is drained (listed in ``draining``)."""
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
