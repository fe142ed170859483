"""Starts SGLang's HTTP server for one engine instance, as `python -m sglang.launch_server`
does, with the engine's API key taken from the environment.

    SGLANG_PYTHON workers/engines/sglang_server.py [--check] <SGLang's flags>

SGLang reads its API key from `--api-key` only, and a flag is visible to every user of the
host in `ps` and was stored on the instance row with the command. The node agent puts the key
in VLMCP_ENGINE_API_KEY instead; this program moves it into the arguments inside the process
(sys.argv is not the process's command line), and takes it out of the environment the
engine's own processes inherit.

`--check` starts nothing: the flags are parsed by the installed SGLang's own argument parser
and each environment variable named in VLMCP_SGLANG_VARIABLES must be one SGLang defines.
It prints {"sglang": version} and exits 0, or prints why not and exits 2, so a launch that
cannot work fails at once with SGLang's own words instead of minutes later in a log.

Run by the Python of SGLang's environment, as a file: it imports nothing of the control plane.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
from importlib.metadata import PackageNotFoundError, version

KEY_VARIABLE = "VLMCP_ENGINE_API_KEY"
VARIABLES_TO_CHECK = "VLMCP_SGLANG_VARIABLES"


def _version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


def check(argv: list[str]) -> int:
    found = _version()
    if not found:
        print(f"SGLang is not installed for {sys.executable}", file=sys.stderr)
        return 2
    # Only once SGLang is found: without it this says so, not an ImportError.
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        reason = str(exc) if isinstance(exc, argparse.ArgumentError) else errors.getvalue().strip().splitlines()[-1]
        print(f"SGLang {found} refuses the command: {reason}", file=sys.stderr)
        return 2
    unknown = [name for name in filter(None, os.environ.get(VARIABLES_TO_CHECK, "").split(","))
               if not hasattr(envs, name)]
    if unknown:
        print(f"SGLang {found} defines no environment variable {', '.join(unknown)}", file=sys.stderr)
        return 2
    print(json.dumps({"sglang": found}))
    return 0


def arguments(argv: list[str], environ) -> list[str]:
    """SGLang's arguments: the command's, and the API key taken out of `environ`."""
    key = environ.pop(KEY_VARIABLE, "")
    environ.pop(VARIABLES_TO_CHECK, None)
    return [*argv, "--api-key", key] if key else list(argv)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--check"]:
        sys.exit(check(argv[1:]))
    sys.argv = [sys.argv[0], *arguments(argv, os.environ)]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
