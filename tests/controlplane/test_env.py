"""controlplane/env.py: malformed configuration stops the process instead of changing it."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.env import (
    EnvError,
    env_bool,
    env_int,
    env_list,
    env_networks,
    local_secret_key,
    parse_database_url,
    validate_redis_url,
)

ROOT = Path(__file__).resolve().parents[2]


# --- env_bool / env_int / env_list -------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", " on "])
def test_env_bool_reads_true_spellings(monkeypatch, raw):
    monkeypatch.setenv("FLAG", raw)
    assert env_bool("FLAG", False) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "OFF"])
def test_env_bool_reads_false_spellings(monkeypatch, raw):
    monkeypatch.setenv("FLAG", raw)
    assert env_bool("FLAG", True) is False


def test_env_bool_unset_or_empty_uses_the_default(monkeypatch):
    monkeypatch.delenv("FLAG", raising=False)
    assert env_bool("FLAG", True) is True
    monkeypatch.setenv("FLAG", "")
    assert env_bool("FLAG", False) is False


@pytest.mark.parametrize("raw", ["maybe", "2", "enabled", "tru"])
def test_env_bool_refuses_anything_else_and_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("DEBUG", raw)
    with pytest.raises(EnvError, match="DEBUG"):
        env_bool("DEBUG", False)


def test_env_int_reads_integers_and_defaults_when_unset(monkeypatch):
    monkeypatch.setenv("WORKERS", "12")
    assert env_int("WORKERS", 1) == 12
    monkeypatch.delenv("WORKERS")
    assert env_int("WORKERS", 7) == 7


@pytest.mark.parametrize("raw", ["ten", "1.5", "12abc", "0x10"])
def test_env_int_refuses_non_integers(monkeypatch, raw):
    monkeypatch.setenv("WORKERS", raw)
    with pytest.raises(EnvError, match="WORKERS"):
        env_int("WORKERS", 1)


def test_env_int_enforces_the_minimum(monkeypatch):
    monkeypatch.setenv("PORT_BASE", "80")
    with pytest.raises(EnvError, match="minimum 1024"):
        env_int("PORT_BASE", 8100, minimum=1024)
    monkeypatch.setenv("PORT_BASE", "1024")
    assert env_int("PORT_BASE", 8100, minimum=1024) == 1024


def test_env_list_splits_on_commas_and_strips(monkeypatch):
    monkeypatch.setenv("HOSTS", "a.example, b.example ,c")
    assert env_list("HOSTS", []) == ["a.example", "b.example", "c"]


def test_env_list_default_is_a_copy(monkeypatch):
    monkeypatch.delenv("HOSTS", raising=False)
    default = ["x"]
    got = env_list("HOSTS", default)
    got.append("y")
    assert default == ["x"]


@pytest.mark.parametrize("raw", ["a,,b", "a,", ",a", " , "])
def test_env_list_refuses_empty_entries(monkeypatch, raw):
    monkeypatch.setenv("HOSTS", raw)
    with pytest.raises(EnvError, match="empty entry"):
        env_list("HOSTS", [])


def test_env_networks_reads_cidrs(monkeypatch):
    monkeypatch.setenv("NETWORKS", "10.20.0.0/16, fd00::/8,127.0.0.1")
    assert env_networks("NETWORKS", []) == ["10.20.0.0/16", "fd00::/8", "127.0.0.1"]


@pytest.mark.parametrize("raw", ["10.0.0.0/33", "10.0.0.1/8", "intranet", "10.0.0.0/8,"])
def test_env_networks_refuses_what_is_not_a_network(monkeypatch, raw):
    monkeypatch.setenv("NETWORKS", raw)
    with pytest.raises(EnvError, match="NETWORKS"):
        env_networks("NETWORKS", [])


# --- DATABASE_URL ------------------------------------------------------------------------


def test_parse_database_url_postgres_with_everything():
    cfg = parse_database_url("postgres://app:s%40cret@db.internal:6543/control?sslmode=require")
    assert cfg.engine == "django.db.backends.postgresql"
    assert (cfg.name, cfg.user, cfg.password) == ("control", "app", "s@cret")
    assert (cfg.host, cfg.port) == ("db.internal", "6543")
    assert cfg.options == {"sslmode": "require"}


def test_parse_database_url_postgresql_scheme_and_no_port():
    cfg = parse_database_url("postgresql://postgres@127.0.0.1/test")
    assert cfg.engine == "django.db.backends.postgresql"
    assert (cfg.name, cfg.user, cfg.password, cfg.host, cfg.port) == (
        "test", "postgres", "", "127.0.0.1", "")
    assert cfg.options is None


def test_parse_database_url_sqlite_absolute_path():
    cfg = parse_database_url("sqlite:////var/lib/cp/db.sqlite3")
    assert cfg.engine == "django.db.backends.sqlite3"
    assert cfg.name == "/var/lib/cp/db.sqlite3"


def test_parse_database_url_sqlite_relative_path():
    cfg = parse_database_url("sqlite:///var/db.sqlite3")
    assert cfg.engine == "django.db.backends.sqlite3"
    assert cfg.name == "var/db.sqlite3"
    assert not Path(cfg.name).is_absolute()


@pytest.mark.parametrize("url", [
    "mysql://root@localhost/app",
    "redis://localhost/0",
    "localhost/app",
    "",
])
def test_parse_database_url_refuses_other_schemes(url):
    with pytest.raises(EnvError, match="not supported"):
        parse_database_url(url)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite://host/db.sqlite3"])
def test_parse_database_url_refuses_malformed_sqlite(url):
    with pytest.raises(EnvError, match="SQLite"):
        parse_database_url(url)


def test_parse_database_url_postgres_needs_a_database_name():
    with pytest.raises(EnvError, match="must name a database"):
        parse_database_url("postgres://postgres@127.0.0.1:5432/")


def test_parse_database_url_refuses_a_bad_port():
    with pytest.raises(EnvError, match="invalid port"):
        parse_database_url("postgres://postgres@127.0.0.1:notaport/test")


# --- REDIS_URL ---------------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0",
    "rediss://:pw@cache.internal:6380/1",
    "unix:///run/redis.sock",
])
def test_validate_redis_url_accepts_and_returns_good_urls(url):
    assert validate_redis_url(url) == url


@pytest.mark.parametrize("url, message", [
    ("http://127.0.0.1:6379/0", "scheme"),
    ("127.0.0.1:6379", "scheme"),
    ("redis:///0", "no host"),
])
def test_validate_redis_url_refuses_bad_urls(url, message):
    with pytest.raises(EnvError, match=message):
        validate_redis_url(url)


# --- the local secret key ----------------------------------------------------------------


def test_local_secret_key_is_generated_once_and_reused(tmp_path):
    path = tmp_path / "nested" / "secret_key"
    first = local_secret_key(path)
    assert len(first) >= 50
    assert path.read_text().strip() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local_secret_key(path) == first
    assert local_secret_key(path) == first


def test_local_secret_key_replaces_a_too_short_key(tmp_path):
    path = tmp_path / "secret_key"
    path.write_text("short")
    key = local_secret_key(path)
    assert key != "short" and len(key) >= 50
    assert local_secret_key(path) == key


def test_local_secret_key_differs_between_installations(tmp_path):
    assert local_secret_key(tmp_path / "a") != local_secret_key(tmp_path / "b")


# --- the settings module as a process sees it ------------------------------------------


def _settings_env(tmp_path, **overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    for name in ("SECRET_KEY", "LOCAL_SECRET_KEY", "DEBUG", "DATABASE_URL", "REDIS_URL",
                 "CELERY_BROKER_URL"):
        env.pop(name, None)
    env.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings", "VAR_DIR": str(tmp_path)})
    env.update(overrides)
    return env


def _setup_django(env):
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); print('ready')"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


def test_settings_refuse_to_start_without_secret_key_when_debug_is_off(tmp_path):
    result = _setup_django(_settings_env(tmp_path, DEBUG="false"))
    assert result.returncode != 0
    assert "ready" not in result.stdout
    assert "EnvError" in result.stderr
    assert "SECRET_KEY is not set" in result.stderr
    assert not (tmp_path / "secret_key").exists()


def test_settings_generate_a_local_key_under_var_dir_in_debug(tmp_path):
    result = _setup_django(_settings_env(tmp_path, DEBUG="true"))
    assert result.returncode == 0, result.stderr
    assert "ready" in result.stdout
    assert len((tmp_path / "secret_key").read_text().strip()) >= 50


def test_settings_refuse_a_malformed_debug_flag(tmp_path):
    result = _setup_django(_settings_env(tmp_path, DEBUG="maybe", SECRET_KEY="k" * 60))
    assert result.returncode != 0
    assert "DEBUG='maybe' is not a boolean" in result.stderr


def test_settings_refuse_a_shared_pictures_url_that_is_not_redis_by_its_name(tmp_path):
    result = _setup_django(_settings_env(tmp_path, DEBUG="true", GATEWAY_SHARED_REPEATS_URL="http://cache:6379/0"))
    assert result.returncode != 0
    assert "GATEWAY_SHARED_REPEATS_URL scheme 'http'" in result.stderr


def _race_for_key(path, queue):
    queue.put(local_secret_key(path))


def test_processes_starting_together_all_get_the_one_stored_key(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for trial in range(5):
        path = tmp_path / f"trial-{trial}" / "secret_key"
        queue = context.Queue()
        workers = [context.Process(target=_race_for_key, args=(path, queue)) for _ in range(6)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=30)
        assert [w.exitcode for w in workers] == [0] * 6
        keys = {queue.get(timeout=5) for _ in workers}
        assert keys == {path.read_text().strip()}
        assert list(path.parent.iterdir()) == [path]  # no temporary files left behind


@pytest.mark.parametrize("url", ["redis://host:abc/0", "redis://host:6379/zero", "redis://:6379/0"])
def test_a_malformed_redis_url_is_refused(url):
    with pytest.raises(EnvError):
        validate_redis_url(url)
