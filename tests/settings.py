"""Test settings: the real PostgreSQL and Redis on 127.0.0.1 unless the environment says otherwise."""

import os
from pathlib import Path

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("SECRET_KEY", "tests-only-secret-key-" + "x" * 40)
os.environ.setdefault("VAR_DIR", str(Path(__file__).resolve().parent.parent / "var" / "tests"))
os.environ.setdefault("NODE_NAME", f"test-node-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")

from controlplane.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
CACHES["default"]["KEY_PREFIX"] = f"tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"  # noqa: F405
