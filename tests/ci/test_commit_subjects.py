"""`.ci/check-commits` refuses a commit whose subject is over 72 characters or runs into its
body, and passes the rest; only commits after the recorded base are checked."""

import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / ".ci" / "check-commits"


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "ci@example.com")
    _git(tmp_path, "config", "user.name", "ci")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "x" * 100)  # before the base
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "commits-base").write_text(_git(tmp_path, "rev-parse", "HEAD") + "\n")
    _git(tmp_path, "add", ".ci")
    _git(tmp_path, "commit", "-q", "-m", "ci: record the base of the subject check")
    return tmp_path


def _commit(repo, message):
    _git(repo, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-m", message)


def _check(repo):
    return subprocess.run([str(CHECK)], cwd=repo, capture_output=True, text=True)


def test_a_subject_of_72_characters_with_a_body_after_a_blank_line_passes(repo):
    _commit(repo, "s" * 72 + "\n\nWhy, with the figures.\n")
    result = _check(repo)
    assert result.returncode == 0, result.stderr


def test_a_subject_of_73_characters_fails(repo):
    _commit(repo, "s" * 73 + "\n\nWhy.\n")
    result = _check(repo)
    assert result.returncode == 1
    assert "subject of 73 characters" in result.stderr


def test_a_subject_running_into_its_body_fails(repo):
    _commit(repo, "engines: a short subject\nthat goes on without a blank line\n")
    result = _check(repo)
    assert result.returncode == 1
    assert "no blank line" in result.stderr


def test_characters_are_counted_not_bytes(repo):
    _commit(repo, "é" * 72 + "\n")
    result = _check(repo)
    assert result.returncode == 0, result.stderr


def test_commits_before_the_base_are_not_checked(repo):
    result = _check(repo)  # the 100-character subject sits before the base
    assert result.returncode == 0, result.stderr
