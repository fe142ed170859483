"""Test settings: the real PostgreSQL and Redis on 127.0.0.1 unless the environment says otherwise."""

import os
import uuid
from pathlib import Path

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/14")
os.environ.setdefault("SECRET_KEY", "tests-only-secret-key-" + "x" * 40)
os.environ.setdefault("VAR_DIR", str(Path(__file__).resolve().parent.parent / "var" / "tests"))
# In-process tests read usage straight after a request; the stream has tests of its own.
os.environ.setdefault("USAGE_OUTBOX", "database")
os.environ.setdefault("NODE_NAME", f"test-node-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")

from controlplane.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
# A prefix per test run: cached keys and quota counters in Redis outlive a run, and tenant ids
# repeat from one run to the next.
CACHES["default"]["KEY_PREFIX"] = f"tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{uuid.uuid4().hex[:8]}"  # noqa: F405

if DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # noqa: F405
    # The embedded-mode run (`make test` runs the accounting tests again on SQLite): a file,
    # not memory, so that a test's threads share it; pytest-django names one per worker.
    DATABASES["default"]["TEST"] = {"NAME": str(Path(VAR_DIR) / "test-embedded.sqlite3")}  # noqa: F405
