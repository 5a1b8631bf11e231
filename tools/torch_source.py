"""Where `make install` takes torch from: the CPU build, without a network call (issue 42, item 1).

On Linux, the default index's ``torch==2.13.0`` is the CUDA build with several GB of nvidia wheels; PyTorch's own
CPU index (https://download.pytorch.org/whl/cpu) serves the CPU build. A machine whose configured pip locations
already offer the ``+cpu`` build (a wheelhouse in ``find-links``, a local mirror, PyTorch's CPU index itself) keeps
them: pointing pip at a remote index there would break an offline install. Everywhere else on Linux this adds
``--index-url https://download.pytorch.org/whl/cpu``. macOS and Windows get the CPU build from the default index.

Prints the pip arguments for torch on stdout and why on stderr. Only pip's own configuration and local folders are
read (``pip config list``, ``PIP_*``; ``file://`` and plain paths); a remote index is never asked.

    python tools/torch_source.py torch==2.13.0                     # torch==2.13.0 [--index-url .../whl/cpu]
    python tools/torch_source.py torch==2.13.0 https://download.pytorch.org/whl/cu126   # a CUDA build, as asked
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: pip settings that name where packages come from (``pip config list`` keys end with these).
LOCATION_KEYS = ("index-url", "extra-index-url", "find-links")


def pip_config() -> dict[str, str]:
    """pip's configuration as ``pip config list`` prints it (files and ``PIP_*`` variables), keys without their
    scope: ``{"find-links": "/opt/wheels", "extra-index-url": "file:///opt/pypi/simple ..."}``; later scopes win."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    config: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in LOCATION_KEYS:
            config[name] = value.strip().strip("'\"")
    for name in LOCATION_KEYS:  # pip config list shows PIP_* too (":env:"), but not under every pip version
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            config[name] = value
    return config


def locations(config: dict[str, str]) -> list[str]:
    """Every place pip would look, in the order given (an index URL, a find-links folder or URL)."""
    found = []
    for name in LOCATION_KEYS:
        found += config.get(name, "").split()
    return found


def local_path(location: str) -> Path | None:
    """The folder a location names on this machine (a path or ``file://``), None for a remote URL."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if not parsed.scheme or re.fullmatch(r"[A-Za-z]", parsed.scheme):  # a path (C:\... on Windows)
        return Path(location)
    return None


def offers_cpu_build(location: str, version: str) -> bool:
    """Whether ``location`` already serves torch ``version`` as its ``+cpu`` build, read without a network call: PyTorch's
    CPU index by its URL, a local folder of wheels or a local simple index by the file names it lists."""
    if location.rstrip("/").endswith("download.pytorch.org/whl/cpu"):
        return True
    folder = local_path(location)
    if folder is None or not folder.is_dir():
        return False
    wanted = re.compile(rf"torch-{re.escape(version)}\+cpu-[^\"'<>/\s]*\.whl")
    names = [p.name for p in folder.glob("torch-*.whl")]
    page = folder / "torch"  # a simple index: ROOT/torch/ lists the files (index.html, or the files themselves)
    if page.is_dir():
        names += [p.name for p in page.iterdir()]
        if (page / "index.html").is_file():
            names += wanted.findall((page / "index.html").read_text(errors="replace"))
    return any(wanted.fullmatch(name) for name in names)


def torch_args(spec: str, config: dict[str, str], system: str, index: str | None = None) -> tuple[list[str], str]:
    """``(pip arguments, why)`` for installing torch as ``spec`` (``torch==2.13.0``) on ``system`` (``platform.system()``)
    with pip configured as ``config`` (``pip_config()``); ``index``: an index the user chose (a CUDA build)."""
    if index:
        return [spec, "--index-url", index], f"from {index}, as asked (TORCH_INDEX)"
    if system != "Linux":
        return [spec], f"the default index's torch is the CPU build on {system}"
    version = spec.partition("==")[2]
    local = next((where for where in locations(config) if version and offers_cpu_build(where, version)), None)
    if local:
        return [spec], f"the CPU build (torch {version}+cpu) is offered by the configured {local}"
    return [spec, "--index-url", CPU_INDEX], (f"the CPU build from PyTorch's CPU index: on Linux the default index's torch "
                                               "is the CUDA build (several GB); a CUDA build instead: TORCH_INDEX=https://"
                                               "download.pytorch.org/whl/cu126 (see pytorch.org/get-started)")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    args, why = torch_args(argv[0], pip_config(), platform.system(), (argv[1] if len(argv) > 1 else "") or None)
    print(f"torch: {why}", file=sys.stderr)
    print(" ".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
