"""Type-check the whole package in ONE mypy run, as Python imports it.

pyproject.toml maps `miles_env.tito` -> `tito/` (and trainer, sandboxes, adapters); mypy has
no package-dir mapping, so checked folder by folder it sees `tito.proxy`, not
`miles_env.tito.proxy`, and every cross-package call goes unchecked. Here the mapping is
laid out as a tree of symlinks in a temporary folder (read from pyproject, so it cannot
drift), `mypy -p miles_env` runs there, and the paths in its report are turned back into
the repository's paths. Usage: python scripts/typecheck.py [extra mypy args]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout(tree: Path) -> dict[str, str]:
    """Symlink the package as installed; return {tree path prefix: repo path prefix}."""
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    top = tree / "miles_env"
    top.mkdir()
    mapped = {name.split(".", 1)[1]: folder for name, folder in package_dir.items() if "." in name}
    for entry in (ROOT / "miles_env").iterdir():
        if entry.name not in mapped:
            (top / entry.name).symlink_to(entry)
    back = {"miles_env/": "miles_env/"}
    for sub, folder in mapped.items():
        (top / sub).symlink_to(ROOT / folder)
        back[f"miles_env/{sub}/"] = f"{folder}/"
    return back


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="miles-env-mypy.") as tmp:
        back = _layout(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "miles_env"]
        proc = subprocess.run(cmd + argv, cwd=tmp, capture_output=True, text=True)
    prefixes = sorted(back, key=len, reverse=True)  # miles_env/tito/ before miles_env/
    for line in (proc.stdout + proc.stderr).splitlines():
        for prefix in prefixes:
            if line.startswith(prefix):
                line = back[prefix] + line[len(prefix) :]
                break
        print(line)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
