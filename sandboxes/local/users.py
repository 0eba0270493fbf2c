"""Who a local sandbox's commands run as: the image's USER, looked up in the image's own files.

Concept: an image says `USER app` (or `1000`, `app:staff`, `1000:1000`); a container runs every
exec as that user, with the supplementary groups /etc/group gives it, and HOME from its
/etc/passwd entry. `resolve_user` does the same lookup in the root filesystem's /etc/passwd and
/etc/group, read from the host side once per sandbox (the image's files, before anything in the
sandbox could change them). No USER means root. A numeric uid without a passwd entry runs with
gid = uid's group as given (else 0) and HOME=/ (as runc does).

Ids are those inside the sandbox: its user namespace maps 0..span-1 to the sandbox's host
range, so an id outside it cannot be used (a one-line ConfigError naming it). Without root the
span is 1 (the caller's own uid as 0): a non-root USER then runs as root inside, logged once.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from miles_env.errors import ConfigError

__all__ = ["ExecUser", "exec_user", "resolve_user"]

_log = logging.getLogger(__name__)
_warned = False


@dataclass(frozen=True, slots=True)
class ExecUser:
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    name: str


def _table(rootfs: str, name: str) -> list[list[str]]:
    try:
        with open(os.path.join(rootfs, "etc", name), encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def _passwd_entry(passwd: list[list[str]], who: str) -> list[str] | None:
    for row in passwd:
        if len(row) >= 6 and (row[0] == who or (who.isdigit() and row[2] == who)):
            return row
    return None


def _group_id(groups: list[list[str]], who: str) -> int | None:
    if who.isdigit():
        return int(who)
    for row in groups:
        if len(row) >= 3 and row[0] == who and row[2].isdigit():
            return int(row[2])
    return None


def _lookup(rootfs: str, user: str, what: str) -> ExecUser:
    name, _, group = user.partition(":")
    passwd, groups = _table(rootfs, "passwd"), _table(rootfs, "group")
    entry = _passwd_entry(passwd, name)
    if entry is None and not name.isdigit():
        raise ConfigError(f"{what}: no user {name!r} in {rootfs.rstrip('/')}/etc/passwd")
    uid = int(entry[2]) if entry else int(name)
    gid = int(entry[3]) if entry and entry[3].isdigit() else 0
    if group:
        found = _group_id(groups, group)
        if found is None:
            raise ConfigError(f"{what}: no group {group!r} in {rootfs.rstrip('/')}/etc/group")
        gid = found
    login = entry[0] if entry else name
    extra = [int(r[2]) for r in groups if len(r) >= 4 and r[2].isdigit() and login in r[3].split(",")]
    home = entry[5] if entry and entry[5] else "/"
    return ExecUser(uid, gid, tuple(sorted({gid, *extra})), home, login)


def resolve_user(rootfs: str | None, user: str | None, span: int) -> ExecUser:
    """The ids and HOME of `user` (an image's USER; None = root) in `rootfs` (None: the host's view)."""
    global _warned
    if rootfs is None or not user:
        root = _passwd_entry(_table(rootfs or "/", "passwd"), "0") if rootfs else None
        return ExecUser(0, 0, (0,), root[5] if root and root[5] else "/root", "root")
    found = _lookup(rootfs, user, f"image USER {user!r}")
    ids = (found.uid, found.gid, *found.groups)
    if max(ids) >= span and span == 1:
        if not _warned:
            _warned = True
            _log.warning(
                "local sandbox without root: one uid only, so image USER %r runs as root inside", user
            )
        return ExecUser(0, 0, (0,), found.home, found.name)
    if max(ids) >= span:
        raise ConfigError(
            f"image USER {user!r}: id {max(ids)} is outside the sandbox's {span} mapped ids (0-{span - 1})"
        )
    return found


def exec_user(rootfs: str | None, user: str, span: int) -> ExecUser:
    """The ids and HOME of one exec's `user` (Sandbox.exec's `user=`, as `docker exec -u` takes it),
    looked up in the image's own files as the image's USER is (None: the host's view, its /etc).

    Unlike the image's USER, never run as someone else: where the sandbox maps one id only (not
    root), a user other than root is a ConfigError, as is an id outside the mapped range."""
    found = _lookup(rootfs or "/", user, f"exec user {user!r}")
    ids = (found.uid, found.gid, *found.groups)
    if max(ids) >= span:
        why = "without root a local sandbox maps one id" if span == 1 else f"the sandbox maps {span} ids"
        raise ConfigError(f"exec user {user!r}: id {max(ids)} cannot be had ({why}: 0-{span - 1})")
    return found
