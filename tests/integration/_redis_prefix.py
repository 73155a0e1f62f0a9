"""A BullMQ key prefix of one test on the shared Redis, its keys deleted afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis.asyncio as aioredis

REDIS_URL = os.environ.get("SDCORE_TEST_REDIS_URL", "redis://127.0.0.1:6379")


@asynccontextmanager
async def redis_prefix() -> AsyncIterator[str]:
    """Yield a fresh prefix; fail with a hint when Redis is not reachable."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose()
        pytest.fail(f"Redis is not reachable at {REDIS_URL} ({exc})", pytrace=False)
    name = f"sdcore-test-{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        keys = [key async for key in client.scan_iter(match=f"{name}:*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
