"""Who looks at the console, and what they may see.

The console sits behind the gateway's keys (``gateway/auth.py``): a tenant's
key sees its own jobs, batches, files and dead letters; a key made with
``tokenfleet keys create --admin`` sees every tenant's, and the keys. A
gateway that asks for no key (``auth=off``, or ``auto`` before the first key)
serves everyone everything, its console included.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from tokenfleet.gateway.auth import caller
from tokenfleet.shared.wire.schemas import ApiKey


@dataclass(frozen=True)
class Viewer:
    key: ApiKey | None  # None: a gateway that asks for no key

    @property
    def admin(self) -> bool:
        return self.key is None or self.key.admin

    @property
    def tenant(self) -> str | None:
        """The tenant whose rows the viewer sees; None: every tenant's."""
        return None if self.admin or self.key is None else self.key.tenant

    @property
    def name(self) -> str:
        if self.key is None:
            return "open gateway"
        return f"{self.key.tenant} (admin)" if self.key.admin else self.key.tenant


def viewer(request: Request) -> Viewer:
    return Viewer(caller(request.state))
