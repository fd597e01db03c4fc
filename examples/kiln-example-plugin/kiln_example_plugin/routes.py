"""The example's HTTP route (mounted only with --endpoint-plugins example_routes)."""
from __future__ import annotations

from fastapi import APIRouter


def router() -> APIRouter:
    """`kiln.endpoint_plugins` entry: the routes to mount."""
    routes = APIRouter()

    @routes.get("/example/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "from kiln-example-plugin"}

    return routes
