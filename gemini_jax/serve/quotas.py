"""API keys, tenants and their compute units (the write-up's DCU, `compute_units` here: one
unit per token per layer computed, prefill, decode and recomputation alike).

Keys file (`serve.api_keys`), JSON:

    {"tenants": {"A": {"pool": 2000000, "per_request": 100000}, "B": {"pool": null}},
     "keys": {"sk-a-1": "A", "sk-b-1": "B"}}

`pool`: units a tenant may use over the server's life (null: no limit); `per_request`: the most
one request may reserve (null: no limit). A request reserves its worst case up front
((prompt + max_tokens) x layers), so a tenant can never overrun its pool mid-stream; what it did
not use comes back when it ends.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Optional

from gemini_jax.errors import AuthError, ConfigError, QuotaExceeded


@dataclass
class Tenant:
    name: str
    pool: Optional[int] = None
    per_request: Optional[int] = None
    used: int = 0
    reserved: int = 0

    @property
    def left(self) -> Optional[int]:
        return None if self.pool is None else self.pool - self.used - self.reserved


class Quotas:
    """Thread-safe: the event loop reserves, the scheduler's thread settles."""

    def __init__(self, tenants: dict[str, Tenant], keys: dict[str, str]):
        self.tenants, self.keys = tenants, keys
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Optional[str]) -> Optional["Quotas"]:
        """The quotas of keys file `path` (None: no keys, anyone is served without quotas)."""
        if path is None:
            return None
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"serve.api_keys={path!r} cannot be read as JSON: {e}") from None
        if not isinstance(data, dict) or set(data) - {"tenants", "keys"} or not isinstance(data.get("keys"), dict):
            raise ConfigError(f"serve.api_keys={path!r} must be {{'tenants': {{...}}, 'keys': {{key: tenant}}}}.")
        tenants = {}
        for name, spec in (data.get("tenants") or {}).items():
            spec = spec or {}
            unknown = set(spec) - {"pool", "per_request"}
            if unknown:
                raise ConfigError(f"serve.api_keys: tenant {name!r} has unknown field(s) {sorted(unknown)}; "
                                  f"allowed: pool, per_request.")
            for f in ("pool", "per_request"):
                v = spec.get(f)
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                    raise ConfigError(f"serve.api_keys: tenants.{name}.{f}={v!r} must be null or an integer >= 0.")
            tenants[name] = Tenant(name, spec.get("pool"), spec.get("per_request"))
        for key, name in data["keys"].items():
            if name not in tenants:
                tenants[name] = Tenant(name)  # a key's tenant with no limits given
        return cls(tenants, dict(data["keys"]))

    def tenant_of(self, key: Optional[str]) -> Tenant:
        if not key:
            raise AuthError("no API key: send 'Authorization: Bearer <key>'.")
        name = self.keys.get(key)
        if name is None:
            raise AuthError("unknown API key.")
        return self.tenants[name]

    def reserve(self, tenant: Tenant, units: int) -> None:
        """Hold `units` for one request, or refuse (QuotaExceeded says what is left)."""
        with self._lock:
            if tenant.per_request is not None and units > tenant.per_request:
                raise QuotaExceeded(f"this request may need {units} compute units; the per-request cap of tenant "
                                    f"{tenant.name!r} is {tenant.per_request}. Lower max_tokens or shorten the prompt.")
            left = tenant.left
            if left is not None and units > left:
                raise QuotaExceeded(f"this request may need {units} compute units; tenant {tenant.name!r} has {left} "
                                    f"of {tenant.pool} left ({tenant.used} used, {tenant.reserved} held by running "
                                    f"requests).")
            tenant.reserved += units

    def settle(self, tenant: Tenant, reserved: int, used: int) -> None:
        """A request ended: release its reservation, charge what it used."""
        with self._lock:
            tenant.reserved -= reserved
            tenant.used += used
