"""A private PostgreSQL server for the sweep tests that need a multi-machine storage (issue 54 item
11): a cluster in a temporary folder, listening on a Unix socket only (no TCP, nothing outside this
machine), trust authentication, stopped at the end. Debian's `postgresql` package provides the
binaries; `.ci/run` installs it and sets APR_REQUIRE_POSTGRES=1, so there the tests never skip.
As root (CI), the cluster runs as the package's `postgres` user, since PostgreSQL refuses root."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

PORT = 54329
DB = "apr_sweeps"


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_owner(cmd: list[str], root: bool) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if root else cmd


def start_server():
    """(url, stop) of a fresh server; pytest.skip (or fail where required) when there is none."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    required = os.environ.get("APR_REQUIRE_POSTGRES") == "1"
    if initdb is None or pg_ctl is None:
        message = "no PostgreSQL server binaries (Debian's postgresql package; .ci/run installs it)"
        if required:
            pytest.fail(message)
        pytest.skip(message)
    root = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="apr-pg-"))
    data, sock = base / "data", base / "sock"
    data.mkdir()
    sock.mkdir()
    if root:
        shutil.chown(base, "postgres")
        shutil.chown(data, "postgres")
        shutil.chown(sock, "postgres")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    subprocess.run(_as_owner([initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"], root),
                   check=True, capture_output=True, env=env, timeout=120)
    options = f"-c listen_addresses='' -k {sock} -p {PORT} -c fsync=off"
    subprocess.run(_as_owner([pg_ctl, "-D", str(data), "-o", options, "-w", "-l", str(base / "log"), "start"], root),
                   check=True, capture_output=True, env=env, timeout=120)
    psql = _bin("createdb")
    subprocess.run(_as_owner([psql, "-h", str(sock), "-p", str(PORT), "-U", "postgres", DB], root),
                   check=True, capture_output=True, env=env, timeout=60)

    def stop() -> None:
        subprocess.run(_as_owner([pg_ctl, "-D", str(data), "-m", "immediate", "stop"], root),
                       capture_output=True, env=env, timeout=60)
        shutil.rmtree(base, ignore_errors=True)

    return f"postgresql+psycopg2://postgres@/{DB}?host={sock}&port={PORT}", stop
