"""Strict readers for settings that come from the environment.

Every reader raises ImproperlyConfigured-style errors (plain ValueError subclasses here,
so this module needs no Django) on malformed values instead of silently falling back:
a typo in production configuration must stop the process, not change its behaviour.

Each reader takes the variable's `help`: what it means, written where it is read. The reference
of environment variables (docs/reference/environment.md, `python -m docs.generate`) is made
from those calls, so every call in the product gives one.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


class EnvError(ValueError):
    pass


def env_str(name: str, default: str | None = None, *, help: str = "") -> str | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value


def env_bool(name: str, default: bool, *, help: str = "") -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={value!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None, help: str = "") -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise EnvError(f"{name}={number} is below the minimum {minimum}")
    return number


def env_choice(name: str, default: str, choices: tuple[str, ...], *, help: str = "") -> str:
    value = env_str(name, default)
    if value not in choices:
        raise EnvError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value


def env_list(name: str, default: list[str], *, help: str = "") -> list[str]:
    value = os.environ.get(name)
    if value is None or value == "":
        return list(default)
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise EnvError(f"{name}={value!r} has an empty entry")
    return items


def env_networks(name: str, default: list[str], *, help: str = "") -> list[str]:
    """A comma-separated list of networks in CIDR notation (10.0.0.0/8, fd00::/8)."""
    networks = env_list(name, default)
    for network in networks:
        try:
            ipaddress.ip_network(network)
        except ValueError as exc:
            raise EnvError(f"{name}: {network!r} is not a network in CIDR notation ({exc})") from None
    return networks


@dataclass(frozen=True)
class DatabaseConfig:
    engine: str
    name: str
    user: str = ""
    password: str = ""
    host: str = ""
    port: str = ""
    options: dict | None = None


_SCHEMES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "sqlite": "django.db.backends.sqlite3",
}


def parse_database_url(url: str) -> DatabaseConfig:
    """Parse `postgres://user:pass@host:port/name` or `sqlite:////abs/path.db`."""
    parts = urlsplit(url)
    engine = _SCHEMES.get(parts.scheme)
    if engine is None:
        raise EnvError(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported (use postgres:// or sqlite://)"
        )
    if engine.endswith("sqlite3"):
        path = unquote(parts.path)
        if parts.netloc or not path or path == "/":
            raise EnvError(
                "DATABASE_URL for SQLite must look like sqlite:////absolute/path.db "
                "or sqlite:///relative/path.db"
            )
        # sqlite:///rel.db -> "/rel.db" after urlsplit; sqlite:////abs.db -> "//abs.db"
        name = path[1:] if not path.startswith("//") else path[1:]
        return DatabaseConfig(engine=engine, name=name)
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise EnvError("DATABASE_URL for PostgreSQL must name a database (postgres://host/name)")
    try:
        port = str(parts.port or "")
    except ValueError:
        raise EnvError(f"DATABASE_URL has an invalid port: {url!r}") from None
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return DatabaseConfig(
        engine=engine,
        name=name,
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        host=parts.hostname or "",
        port=port,
        options=options or None,
    )


def validate_redis_url(url: str, name: str = "REDIS_URL") -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise EnvError(f"{name} scheme {parts.scheme!r} is not redis://, rediss:// or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise EnvError(f"{name} {url!r} has no host")
    try:
        _ = parts.port  # urllib only checks the port when asked for it
    except ValueError:
        raise EnvError(f"{name} {url!r} has an invalid port") from None
    db = parts.path.lstrip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise EnvError(f"{name} {url!r}: the database must be a number")
    return url


def restrict_to_owner(path: Path) -> None:
    """Create `path` readable by its owner alone (0600), or make it so: an embedded database
    holds API key hashes and every tenant's usage."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)


def local_secret_key(path: Path) -> str:
    """A secret generated once and kept under var/ so that sessions survive restarts.

    Web, worker and beat may start together: each writes a private temporary file and
    links it into place, so the first writer wins and everyone reads the same key.
    """
    if path.exists():
        key = path.read_text().strip()
        if len(key) >= 50:
            return key
        path.unlink(missing_ok=True)  # a truncated key is useless; make a new one
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret_key.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64))
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process won the race; use its key
    finally:
        os.unlink(tmp)
    return path.read_text().strip()
