"""Who a local sandbox's exec runs as (sandboxes/local/users.py), looked up in an image's own files.

The image's USER may fall back to root where the sandbox maps one id (no root on the host: logged
once); one exec's `user=` never does (Sandbox.exec's contract: never a run as someone else)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_env.errors import ConfigError
from miles_env.sandboxes.local.users import ExecUser, exec_user, resolve_user

_PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
_GROUP = "root:x:0:\nstaff:x:50:app\napp:x:1000:\n"


@pytest.fixture
def rootfs(tmp_path: Path) -> str:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text(_PASSWD)
    (tmp_path / "etc" / "group").write_text(_GROUP)
    return str(tmp_path)


def test_an_exec_user_is_looked_up_as_docker_exec_u_does(rootfs: str) -> None:
    assert exec_user(rootfs, "app", 65536) == ExecUser(1000, 1000, (50, 1000), "/home/app", "app")
    assert exec_user(rootfs, "app:staff", 65536).gid == 50
    assert exec_user(rootfs, "1000:50", 65536) == ExecUser(1000, 50, (50,), "/home/app", "app")
    assert exec_user(rootfs, "4242", 65536) == ExecUser(4242, 0, (0,), "/", "4242")  # no entry: as runc
    with pytest.raises(ConfigError, match=r"exec user 'ghost': no user 'ghost' in .*/etc/passwd"):
        exec_user(rootfs, "ghost", 65536)
    with pytest.raises(ConfigError, match="exec user 'app:wheel': no group 'wheel'"):
        exec_user(rootfs, "app:wheel", 65536)


def test_without_the_ids_an_exec_user_is_refused_never_run_as_root(rootfs: str) -> None:
    assert exec_user(rootfs, "root", 1).uid == 0
    with pytest.raises(ConfigError, match="exec user 'app': id 1000 cannot be had .without root"):
        exec_user(rootfs, "app", 1)
    with pytest.raises(
        ConfigError, match="exec user '70000': id 70000 cannot be had .the sandbox maps 65536"
    ):
        exec_user(rootfs, "70000", 65536)
    assert resolve_user(rootfs, "app", 1).uid == 0  # the image's USER: root inside, logged once
