"""A small image for the sandbox contract: a root filesystem made from the host's own binaries.

What it holds: the host's dash as /bin/sh and its coreutils (with exactly the shared libraries
they load, found with ldd), an /etc/passwd with root and a non-root user `app` (uid 1000, home
/home/app), an /etc/group giving `app` a supplementary group, a tool on a PATH only the image's
ENV names (/opt/tool/bin), a WORKDIR owned by `app` with a file of `app`'s, and nothing else: no
python, no package manager. IMAGE is its config (what a Dockerfile's ENV, USER and WORKDIR would
say); the docker contract imports the same tree as an image with those lines, the local contract
hands IMAGE to its provider with the tree as spec.rootfs, the way the images package does.

Built once per test process (`build_rootfs`), ~10 MB; owners are set only when we are root.
`ImageProvider` is the local provider handing out IMAGE for it.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from miles_env.sandboxes.images.config import ImagesConfig
from miles_env.sandboxes.images.oci import ImageConfig
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.types import SandboxSpec

__all__ = ["IMAGE", "IMAGE_PATH", "ImageProvider", "build_rootfs", "docker_image"]

IMAGE_PATH = "/opt/tool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE = ImageConfig(
    env={"PATH": IMAGE_PATH, "GREETING": "from the image"}, user="app", workdir="/home/app/proj"
)
_PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
_GROUP = "root:x:0:\nstaff:x:50:app\napp:x:1000:\nnogroup:x:65534:\n"
_built: dict[str, Path] = {}


def _host_files() -> set[str]:
    files = {os.path.realpath("/bin/sh")}
    out = subprocess.run(["dpkg", "-L", "coreutils"], capture_output=True, text=True).stdout
    files.update(p for p in out.split() if re.match(r"^/(usr/)?s?bin/", p) and os.path.isfile(p))
    for f in sorted(files):
        libs = subprocess.run(["ldd", f], capture_output=True, text=True).stdout
        files.update(re.findall(r"(/\S+\.so[^\s]*)", libs))
    return files


def _copy(files: set[str], root: Path) -> None:
    for f in sorted(files):
        real = os.path.realpath(f)
        target = root / os.path.realpath(os.path.dirname(f)).lstrip("/") / os.path.basename(f)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            shutil.copy2(real, target)
    for name in ("bin", "sbin", "lib", "lib64"):  # a merged /usr, like the host's
        if os.path.islink(f"/{name}") and not (root / name).exists():
            (root / name).symlink_to(os.readlink(f"/{name}"))
    if not (root / "usr/bin/sh").exists():
        (root / "usr/bin/sh").symlink_to(os.path.basename(os.path.realpath("/bin/sh")))


def _own(path: Path, uid: int, gid: int) -> None:
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def build_rootfs(parent: Path) -> Path:
    """The image's files under `parent`/rootfs (once per process)."""
    if "root" in _built:
        return _built["root"]
    root = parent / "rootfs"
    _copy(_host_files(), root)
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(_PASSWD)
    (etc / "group").write_text(_GROUP)
    tool = root / "opt/tool/bin/tool"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\necho tool from the image PATH\n")
    tool.chmod(0o755)
    (root / "root").mkdir(mode=0o700)
    (root / "root/secret").write_text("root's own\n")
    os.chmod(root / "root/secret", 0o600)
    # a setuid-root helper, as a task gives its non-root user a root-only file (a copy of cat)
    rootcat = root / "usr/local/bin/rootcat"
    rootcat.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(shutil.which("cat") or "/bin/cat"), rootcat)
    _own(rootcat, 0, 0)
    os.chmod(rootcat, 0o4755)
    proj = root / "home/app/proj"
    proj.mkdir(parents=True)
    (proj / "owned.txt").write_text("app's file\n")
    for path in (root / "home/app", proj, proj / "owned.txt"):
        _own(path, 1000, 1000)
    for sub in ("tmp", "workspace"):
        (root / sub).mkdir()
    os.chmod(root / "tmp", 0o1777)
    _built["root"] = root
    return root


class ImageProvider(LocalSandboxProvider):
    """The local provider with an image's config for its rootfs, as sandboxes/images gives the
    config of an image it unpacked (`images`: rootfs path -> ImageConfig)."""

    def __init__(self, config: LocalSandboxConfig, images: dict[str, ImageConfig]) -> None:
        super().__init__(config)
        self.images = images

    def image_config(self, spec: SandboxSpec) -> ImageConfig | None:
        return self.images.get(spec.rootfs or "") or super().image_config(spec)


def docker_image(client: object, rootfs: Path) -> str:
    """The same tree as a docker image with IMAGE's ENV, USER and WORKDIR (imported once per engine)."""
    repository, tag = ImagesConfig().repo("contract-image"), "2"  # the session's namespace
    api = client.api  # type: ignore[attr-defined]
    try:
        api.inspect_image(f"{repository}:{tag}")
        return f"{repository}:{tag}"
    except Exception:  # noqa: BLE001 - not there yet
        pass
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(rootfs), arcname=".")  # owners as they are on disk (app's files: uid 1000)
    changes = [f"ENV {k}={json.dumps(v)}" for k, v in IMAGE.env.items()]
    changes += [f"USER {IMAGE.user}", f"WORKDIR {IMAGE.workdir}", 'CMD ["/bin/sh"]']
    api.import_image_from_data(buf.getvalue(), repository=repository, tag=tag, changes=changes)
    return f"{repository}:{tag}"
