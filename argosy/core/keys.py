"""API keys and their policy, and the token buckets that limit them (SPEC §7).

A key is known only by its SHA-256 (the plain key is hashed as it is read and never kept,
printed or logged; logs and events name a key by its `name`). `KeyRing.find` compares the
presented key's hash with every known hash in constant time, so neither the match nor its
position leaks through timing.

Keys come from `--api-key KEY` (repeatable; named `key-1`, `key-2`…), from `--api-key-file`
(one key per line, `#` comments; named `file-1`…; keeps keys out of the process listing) and
from `--api-keys keys.toml` with a policy per key:

    [[key]]
    name = "alice"                 # required, unique; what logs, events and metrics show
    key = "sk-alice-…"             # or key_sha256 = "<64 hex>" (the file then holds no secret)
    models = ["smollm2*", "minilm"]  # globs over model ids and aliases; default: all
    requests_per_minute = 60       # default: no limit
    tokens_per_minute = 20000      # prompt + generated tokens; default: no limit
    max_concurrent = 4             # requests in flight at once; default: no limit
    max_qos = "background"         # the highest QoS class it may use; default interactive
    expires = 2027-01-01T00:00:00Z # a TOML date-time (or an RFC 3339 string); default: never

A bad file stops start-up with the file, the key's position and the reason.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import hmac
import math
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argosy.config import QOS_CLASSES
from argosy.errors import InvalidRequestError

_POLICY_FIELDS = {
    "name",
    "key",
    "key_sha256",
    "models",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_qos",
    "expires",
    "admin",
}


def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    name: str
    digest: bytes  # SHA-256 of the key
    models: tuple[str, ...] = ()  # globs; empty: every model
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    max_qos: str = QOS_CLASSES[0]  # the highest class it may use (classes: highest first)
    expires: float | None = None  # epoch seconds
    admin: bool = False  # may change what the server serves (load / unload LoRA adapters)

    def allows_model(self, names: tuple[str, ...]) -> bool:
        """Whether any of a model's names (id and aliases) matches one of the key's globs."""
        return not self.models or any(fnmatch.fnmatchcase(n, glob) for n in names for glob in self.models)

    def allows_qos(self, qos: str) -> bool:
        return QOS_CLASSES.index(qos) >= QOS_CLASSES.index(self.max_qos)

    def is_expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (time.time() if now is None else now) >= self.expires


class KeyRing:
    def __init__(self, policies: list[KeyPolicy]) -> None:
        names = [p.name for p in policies]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidRequestError(f"API key names must be unique: {', '.join(duplicates)}", "api_keys")
        self.policies = policies

    def __bool__(self) -> bool:
        return bool(self.policies)

    def find(self, key: str) -> KeyPolicy | None:
        """The policy of `key`, compared in constant time against every known key."""
        digest = key_hash(key)
        found: KeyPolicy | None = None
        for policy in self.policies:
            if hmac.compare_digest(policy.digest, digest):
                found = policy
        return found

    @property
    def names(self) -> frozenset[str]:
        return frozenset(p.name for p in self.policies)


def _fail(path: Path, where: str, reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"{path}: {where}: {reason}", "api_keys")


def _number(value: Any, path: Path, where: str, *, integer: bool = False) -> float | None:
    if value is None:
        return None
    is_number = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not is_number or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise _fail(path, where, f"expected {kind}, got {value!r}")
    return float(value)


def _expiry(value: Any, path: Path, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise _fail(path, where, f"not an RFC 3339 date-time: {value!r}") from None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time(), dt.UTC)
    if not isinstance(value, dt.datetime):
        raise _fail(path, where, f"expected a date-time, got {value!r}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.timestamp()


def policy_from_table(table: Any, path: Path, position: int) -> KeyPolicy:
    where = f"[[key]] #{position}"
    if not isinstance(table, dict):
        raise _fail(path, where, "expected a table")
    unknown = sorted(set(table) - _POLICY_FIELDS)
    if unknown:
        raise _fail(path, where, f"unknown field(s) {', '.join(unknown)}")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _fail(path, where, "'name' is required (a non-empty string)")
    where = f"key {name!r}"
    if ("key" in table) == ("key_sha256" in table):
        raise _fail(path, where, "give exactly one of 'key' and 'key_sha256'")
    if "key" in table:
        if not isinstance(table["key"], str) or not table["key"]:
            raise _fail(path, where, "'key' must be a non-empty string")
        digest = key_hash(table["key"])
    else:
        try:
            digest = bytes.fromhex(table["key_sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise _fail(path, where, "'key_sha256' must be 64 hex digits")
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise _fail(path, where, "'models' must be a list of model ids or globs")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise _fail(path, where, f"'admin' must be true or false, got {admin!r}")
    max_qos = table.get("max_qos", QOS_CLASSES[0])
    if max_qos not in QOS_CLASSES:
        raise _fail(path, where, f"'max_qos' must be one of {', '.join(QOS_CLASSES)}, got {max_qos!r}")
    concurrent = _number(table.get("max_concurrent"), path, f"{where}: max_concurrent", integer=True)
    return KeyPolicy(
        name=name,
        digest=digest,
        models=tuple(models),
        requests_per_minute=_number(table.get("requests_per_minute"), path, f"{where}: requests_per_minute"),
        tokens_per_minute=_number(table.get("tokens_per_minute"), path, f"{where}: tokens_per_minute"),
        max_concurrent=int(concurrent) if concurrent is not None else None,
        max_qos=max_qos,
        expires=_expiry(table.get("expires"), path, f"{where}: expires"),
        admin=admin,
    )


def load_keys_toml(path: str | Path) -> list[KeyPolicy]:
    path = Path(path).expanduser()
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise _fail(path, "cannot read it", str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise _fail(path, "not valid TOML", str(exc)) from None
    unknown = sorted(set(document) - {"key"})
    if unknown:
        raise _fail(path, "top level", f"unknown table(s) {', '.join(unknown)} (keys are [[key]] tables)")
    tables = document.get("key", [])
    if not isinstance(tables, list):
        raise _fail(path, "top level", "keys are [[key]] tables")
    return [policy_from_table(table, path, position) for position, table in enumerate(tables, start=1)]


def load_key_file(path: str | Path) -> list[KeyPolicy]:
    """One key per line (blank lines and `#` comments skipped), named file-1, file-2…"""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"{path}: cannot read it: {exc}", "api_key_file") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise InvalidRequestError(f"{path}: no key in it", "api_key_file")
    return [KeyPolicy(name=f"file-{i}", digest=key_hash(k)) for i, k in enumerate(keys, start=1)]


def key_ring(
    keys: list[str], key_file: str | None, keys_toml: str | None, admin_keys: list[str] | None = None
) -> KeyRing:
    policies = [KeyPolicy(name=f"key-{i}", digest=key_hash(k)) for i, k in enumerate(keys, start=1)]
    policies += [
        KeyPolicy(name=f"admin-{i}", digest=key_hash(k), admin=True)
        for i, k in enumerate(admin_keys or [], start=1)
    ]
    if key_file is not None:
        policies += load_key_file(key_file)
    if keys_toml is not None:
        policies += load_keys_toml(keys_toml)
    return KeyRing(policies)


# -- limits ----------------------------------------------------------------------------------


@dataclass(slots=True)
class TokenBucket:
    """`rate` per minute, holding at most `burst`; a take past empty says how long to wait."""

    rate_per_minute: float
    burst: float
    level: float | None = None  # None: full at first use (negative: in debt)
    updated: float = 0.0

    def _refill(self, now: float) -> float:
        if self.level is None:
            self.level = self.burst
        else:
            self.level = min(
                self.burst, self.level + max(0.0, now - self.updated) * self.rate_per_minute / 60.0
            )
        self.updated = now
        return self.level

    def take(self, amount: float = 1.0, now: float | None = None) -> float:
        """0 when `amount` was taken; else the seconds until it could be (nothing taken)."""
        now = time.monotonic() if now is None else now
        level = self._refill(now)
        if level >= amount:
            self.level = level - amount
            return 0.0
        return (amount - level) * 60.0 / self.rate_per_minute

    def wait_for_positive(self, now: float | None = None) -> float:
        """0 when the bucket is not in debt; else the seconds until it is not."""
        now = time.monotonic() if now is None else now
        level = self._refill(now)
        return 0.0 if level > 0 else (-level + 1e-9) * 60.0 / self.rate_per_minute

    def spend(self, amount: float, now: float | None = None) -> None:
        """Take `amount` after the fact (tokens counted once a request ends): may go into debt."""
        now = time.monotonic() if now is None else now
        self.level = self._refill(now) - amount


class KeyLimits:
    """Per key: requests per minute, tokens per minute (spent when a request ends, so a
    request is refused while the key is in debt) and requests in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self._in_flight: dict[str, int] = {}

    def admit(self, policy: KeyPolicy) -> tuple[str, float] | None:
        """None when `policy`'s key may start a request now (it is counted in flight);
        else (which limit, seconds to wait)."""
        with self._lock:
            if (
                policy.max_concurrent is not None
                and self._in_flight.get(policy.name, 0) >= policy.max_concurrent
            ):
                return "max_concurrent", 1.0
            if policy.tokens_per_minute is not None:
                bucket = self._bucket(self._tokens, policy.name, policy.tokens_per_minute)
                wait = bucket.wait_for_positive()
                if wait > 0:
                    return "tokens_per_minute", wait
            if policy.requests_per_minute is not None:
                bucket = self._bucket(self._requests, policy.name, policy.requests_per_minute)
                wait = bucket.take()
                if wait > 0:
                    return "requests_per_minute", wait
            self._in_flight[policy.name] = self._in_flight.get(policy.name, 0) + 1
            return None

    def done(self, policy: KeyPolicy, num_tokens: int) -> None:
        with self._lock:
            self._in_flight[policy.name] = max(0, self._in_flight.get(policy.name, 0) - 1)
            if policy.tokens_per_minute is not None and num_tokens:
                self._bucket(self._tokens, policy.name, policy.tokens_per_minute).spend(num_tokens)

    @staticmethod
    def _bucket(buckets: dict[str, TokenBucket], name: str, rate: float) -> TokenBucket:
        bucket = buckets.get(name)
        if bucket is None:
            bucket = buckets[name] = TokenBucket(rate, burst=rate)
        return bucket


class AddressLimits:
    """A token bucket per client address (`rate` per minute, `burst` deep); the table is
    bounded (least recently seen addresses dropped first, a dropped one starts full)."""

    def __init__(
        self, rate_per_minute: float, burst: float | None = None, max_addresses: int = 65536
    ) -> None:
        self.rate_per_minute = rate_per_minute
        self.burst = burst if burst is not None else max(1.0, rate_per_minute)
        self.max_addresses = max_addresses
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def take(self, address: str) -> float:
        """0: allowed; else seconds until the address may send again."""
        with self._lock:
            bucket = self._buckets.pop(address, None)
            if bucket is None:
                bucket = TokenBucket(self.rate_per_minute, self.burst)
                if len(self._buckets) >= self.max_addresses:
                    self._buckets.pop(next(iter(self._buckets)))
            self._buckets[address] = bucket  # most recently seen last
            return bucket.take()


def config_key_ring(config: Any) -> KeyRing:
    """The keys a ServerConfig names: --api-key, --api-key-file, --api-keys and --admin-key."""
    return key_ring(config.api_key, config.api_key_file, config.api_keys, config.admin_key)
