"""A local sandbox's outbound network (NetworkPolicy.PUBLIC): slirp4netns on its network namespace.

Concept: a sandbox's network namespace has only `lo` (bwrap --unshare-net). For a sandbox whose
spec asks for the network, the zygote attaches slirp4netns to it once the sandbox is made: a
user-mode TCP/IP stack (libslirp) that runs in the host's network namespace as the sandbox's own
unprivileged host uid (as root; else as the caller) and gives the namespace a tap device `eth0`
(10.0.2.100/24, gateway 10.0.2.2, DNS 10.0.2.3: layout.py binds that /etc/resolv.conf). Every
connection a process inside opens is made again by slirp4netns as an ordinary socket of the
host: outbound TCP, UDP and DNS work, nothing comes in (no port is forwarded), and no
capability, bridge, veth or iptables rule of the host is needed.

Invariant: nothing inside reaches the host's loopback. `--disable-host-loopback` makes
slirp4netns refuse every connection to the host's 127.0.0.0/8 (10.0.2.2, the address that would
map to it, answers "network unreachable"), so the TITO proxy, Redis and the image registry, all
on the host's 127.0.0.1, stay out of reach. The host's other addresses are reachable, as from a
docker bridge: a service bound to 0.0.0.0 is as open to a sandbox with network as to the LAN.
slirp4netns parses what the sandbox sends, so it runs `--enable-sandbox` (a mount namespace with
only the host's /etc and /run, no capability) and `--enable-seccomp`.

Lifecycle: `attach()` forks it from the zygote (so it is in the zygote's pids cgroup) and returns
once its ready fd says the interface is up. It exits at EOF on its exit fd, whose write end only
the zygote holds: at `stop` (`Netstack.detach()`, which waits for it and SIGKILLs it if need
be) or when the zygote dies, however it dies; it also has PR_SET_PDEATHSIG, and `stop`'s
kill_cgroup SIGKILLs whatever is left in the cgroup. Nothing of it outlives the sandbox.

Why slirp4netns and not pasta (passt), the other user-mode stack Debian packages: slirp4netns's
exit and ready fds are the zygote's own lifecycle (a pipe's EOF ends it, as it ends the
sandbox's init), and one flag keeps the host's loopback out, where pasta forwards ports both
ways by default (-t/-u/-T/-U auto: the namespace's loopback reaches every port listening on the
host's) and maps its gateway to the host (--no-map-gw): five defaults to turn off, each a hole
if missed. Run by root, pasta also drops to `nobody` by itself and then cannot join the
sandbox's user namespace (`Couldn't open user namespace ...: Permission denied`, bookworm's
0.0~git20230309). Both open /dev/net/tun inside the namespace, as the uid they run as.

/dev/net/tun must therefore be readable and writable by that uid: mode 0666, as udev makes it.
On a host without udev (0600) and as root, slirp4netns runs in a mount namespace of its own
whose /dev/net is a tmpfs holding a 0666 node of the same device; without root such a host
gives no sandbox a network, and the error says why.

Stdlib only: imported by zygote.py (its sibling) and run in the zygote.
"""

from __future__ import annotations

import os
import select
import signal
import stat
from typing import Any

import namespaces as nsx  # type: ignore[import-not-found]  # sibling module (sys.path[0])

__all__ = ["Netstack", "attach", "open_low_ports"]

NAMESERVER = "10.0.2.3"  # slirp4netns's DNS forwarder (to the host's resolvers)
_READY_TIMEOUT_S = 20.0
_STOP_TIMEOUT_S = 2.0
_TUN = "/dev/net/tun"
_MS_NOSUID, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 0x2, 0x8, 0x4000, 0x40000
# Its fds once placed: 3 the sandbox's network namespace, 4 the exit fd's read end, 5 the ready
# fd's write end. No --userns-path: it starts in the sandbox's outer user namespace already
# (_exec says why).
_OPTIONS = [
    "--configure",
    "--mtu=65520",
    "--disable-host-loopback",
    "--enable-sandbox",
    "--enable-seccomp",
    "--exit-fd=4",
    "--ready-fd=5",
    "--netns-type=path",
    "/proc/self/fd/3",
    "eth0",
]


class Netstack:
    """A running slirp4netns: a pidfd of it and the write end of its exit fd."""

    def __init__(self, pidfd: int, exit_w: int) -> None:
        self.pidfd, self.exit_w = pidfd, exit_w

    def fds(self) -> list[int]:
        return [self.pidfd, self.exit_w]

    def detach(self) -> bool:
        """End it (EOF on its exit fd, SIGKILL if it lingers); True once it is gone."""
        os.close(self.exit_w)
        gone = bool(select.select([self.pidfd], [], [], _STOP_TIMEOUT_S)[0])
        if not gone:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            gone = bool(select.select([self.pidfd], [], [], _STOP_TIMEOUT_S)[0])
        os.close(self.pidfd)
        return gone


def attach(zygote: Any, slirp: str) -> Netstack:
    """Start slirp4netns on the zygote's running sandbox; back once its `eth0` is up. OSError with
    slirp4netns's own words if it does not come up."""
    exit_r, exit_w = os.pipe()
    ready_r, ready_w = os.pipe()
    log_r, log_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _exec(zygote, [slirp, *_OPTIONS], [zygote.ns["net"], exit_r, ready_w], log_w)
    netstack = Netstack(os.pidfd_open(pid), exit_w)
    for fd in (exit_r, ready_w, log_w):
        os.close(fd)
    try:
        if select.select([ready_r], [], [], _READY_TIMEOUT_S)[0] and os.read(ready_r, 1) == b"1":
            return netstack
        netstack.detach()
        raise OSError(_failure(log_r))
    finally:
        os.close(ready_r)
        os.close(log_r)  # it may still write there: SIGPIPE is ignored in it, so it gets EPIPE


def open_low_ports(zygote: Any) -> bool:
    """Let every user of the zygote's running sandbox bind ports below 1024 in its own network
    namespace (`net.ipv4.ip_unprivileged_port_start = 0`), as Docker does for every container since
    20.10: a task's server on port 80 works as in a container, and since the namespace is the
    sandbox's own (no port of the host, nothing forwarded in), it opens nothing to anyone else.
    The sandbox's root cannot write it itself (its capabilities are in the inner user namespace;
    the network namespace belongs to the outer one, and /proc/sys is read-only inside). True once
    set; on failure the sandbox is used as it is (low ports stay refused)."""
    done_r, done_w = os.pipe()
    if os.fork() == 0:
        os.close(done_r)
        try:
            zygote.become_host_uid()
            nsx.join(zygote.userns.outer, nsx.CLONE_NEWUSER, "user")
            nsx.join(zygote.ns["net"], nsx.CLONE_NEWNET, "net")
            with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as f:
                f.write("0")
            os.write(done_w, b"1")
        finally:
            os._exit(0)
    os.close(done_w)
    try:
        return os.read(done_r, 1) == b"1"  # EOF (b"") once it exits without saying so
    finally:
        os.close(done_r)


def _exec(zygote: Any, argv: list[str], fds: list[int], log: int) -> None:
    """In a fork of the zygote: become slirp4netns, with `fds` as its fds 3.., in the sandbox's
    outer user namespace (which owns its network namespace), as its root. Why there: slirp4netns
    1.2 (and 1.3) started by a non-root uid with `--enable-sandbox` joins a user namespace only
    for `--netns-type=pid`, then fails at setegid(0); started as root of the namespace it makes
    its sandbox there (a mount namespace, its capabilities dropped). Never returns."""
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its own child (the zygote ignores it)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # its stderr's reader leaves once it is up
        if os.geteuid() == 0 and stat.S_IMODE(os.stat(_TUN).st_mode) & 0o006 != 0o006:
            _private_tun()
        zygote.become_host_uid()
        nsx.join(zygote.userns.outer, nsx.CLONE_NEWUSER, "user")
        nsx.die_with_parent()  # set after the uid and namespace changes, which clear it
        null = os.open(os.devnull, os.O_RDWR)
        nsx.place_fds([null, log, log, *fds])
        log = 2
        os.execv(argv[0], argv)
    except BaseException as e:  # noqa: BLE001 - reported on the log, then die
        os.write(log, f"miles-env zygote: cannot run {argv[0]}: {e}\n".encode())
    finally:
        os._exit(127)


def _private_tun() -> None:
    """As root, where /dev/net/tun is not open to every user: a mount namespace of our own whose
    /dev/net holds a node of the same device that is (its opener still needs CAP_NET_ADMIN over
    the sandbox's network namespace to make a device there, which only the sandbox's uid has)."""
    device = os.stat(_TUN).st_rdev
    nsx.unshare(nsx.CLONE_NEWNS)
    nsx.mount("none", "/", "", _MS_REC | _MS_PRIVATE)  # nothing of ours propagates to the host
    nsx.mount("tmpfs", "/dev/net", "tmpfs", _MS_NOSUID | _MS_NOEXEC, "mode=0755,size=16k")
    os.mknod(_TUN, stat.S_IFCHR | 0o666, device)
    os.chmod(_TUN, 0o666)  # past the umask


def _failure(log_r: int) -> str:
    os.set_blocking(log_r, False)
    try:
        log = os.read(log_r, 1 << 16).decode(errors="replace").strip()
    except BlockingIOError:
        log = ""
    lines = [ln for ln in log.splitlines() if "seccomp is experimental" not in ln]
    text = "; ".join(lines)[-1500:] or "no output"
    if "/dev/net/tun" in text and "Permission denied" in text:
        text += " (without root, /dev/net/tun must be readable and writable by every user: mode 0666)"
    return f"slirp4netns did not bring the sandbox's network up: {text}"
