"""``promtool`` for the tests of the alert rules: from PATH, else from a cache directory, else Debian's
``prometheus`` package downloaded and unpacked there (``apt-get download`` + ``dpkg-deb -x``: no root, no daemon
installed). PyPI has no package shipping it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class PromtoolUnavailable(Exception):
    """promtool is not installed and could not be fetched (the message says why)."""


def cache_dir() -> Path:
    """``$VMQUOTA_TOOLS_CACHE``, else ``$XDG_CACHE_HOME/vmquota/tools``, else ``~/.cache/vmquota/tools``."""
    explicit = os.environ.get("VMQUOTA_TOOLS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vmquota" / "tools"


def find_promtool() -> str:
    """A working promtool; raises :class:`PromtoolUnavailable`."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    cached = cache_dir() / "promtool"
    if not (cached.is_file() and os.access(cached, os.X_OK)):
        fetch_promtool(cached)
    return str(cached)


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


def fetch_promtool(dest: Path) -> None:
    """Download Debian's ``prometheus`` package into a temporary directory and keep its ``promtool`` at ``dest``.
    ``apt-get download`` needs the package lists; where there are none and this runs as root, they are updated once
    (``apt-get update``)."""
    apt, dpkg_deb = shutil.which("apt-get"), shutil.which("dpkg-deb")
    if apt is None or dpkg_deb is None:
        raise PromtoolUnavailable("promtool is not on PATH and there is no apt-get/dpkg-deb to fetch Debian's package")
    with tempfile.TemporaryDirectory(prefix="promtool-") as tmp:
        work = Path(tmp)
        got = _run([apt, "download", "prometheus"], work)
        if got.returncode != 0 and os.geteuid() == 0:
            _run([apt, "update", "-qq"], work)
            got = _run([apt, "download", "prometheus"], work)
        debs = sorted(work.glob("prometheus_*.deb"))
        if got.returncode != 0 or not debs:
            raise PromtoolUnavailable(f"promtool is not on PATH and `apt-get download prometheus` failed: {got.stderr}")
        unpacked = _run([dpkg_deb, "-x", str(debs[0]), "root"], work)
        binary = work / "root" / "usr" / "bin" / "promtool"
        if unpacked.returncode != 0 or not binary.is_file():
            raise PromtoolUnavailable(f"{debs[0].name} has no usr/bin/promtool: {unpacked.stderr}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.{os.getpid()}")
        shutil.copy2(binary, partial)
        os.replace(partial, dest)  # (atomic: a parallel run sees the whole binary or none)
