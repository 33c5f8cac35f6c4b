"""Each tenant's own index of its files and batches, filled once for the
records made before there were such indexes.

Listings (``GET /v1/files``, ``GET /v1/batches``) read a tenant's index
(``Keys.tenant_files``, ``Keys.tenant_batches``), never another tenant's
records. A fleet upgraded from one without those indexes has records only in
the namespace-wide ones: the first gateway to start after the upgrade copies
each into its tenant's index, then sets a mark so that no later start reads
them all again. Copies are idempotent (ZADD of the same score), so gateways
that start together and each copy are harmless.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.shared.wire.keys import Keys

# Records read per round trip while copying.
PAGE = 500


async def index_by_tenant(client: Any, keys: Keys) -> int:
    """Copy every file and batch into its tenant's index unless done before;
    the number of records copied."""
    if await client.exists(keys.tenant_indexes_done):
        return 0
    copied = 0
    for index, record_key, tenant_index in (
            (keys.files, keys.file, keys.tenant_files),
            (keys.batches, keys.batch, keys.tenant_batches)):
        start = 0
        while ids := await client.zrange(index, start, start + PAGE - 1, withscores=True):
            start += len(ids)
            pipe = client.pipeline(transaction=False)
            for record_id, _ in ids:
                pipe.hget(record_key(record_id.decode()), "tenant")
            tenants = await pipe.execute()
            pipe = client.pipeline(transaction=False)
            for (record_id, score), tenant in zip(ids, tenants):
                if tenant is not None:
                    pipe.zadd(tenant_index(tenant.decode()), {record_id: score})
                    copied += 1
            await pipe.execute()
    await client.set(keys.tenant_indexes_done, "1")
    return copied
