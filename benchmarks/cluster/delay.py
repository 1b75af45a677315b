"""Per-link-class latency of an emulated cluster: a user-space delay line (delayline.c) in the switch
namespace, one tap per delayed link class.

Method in full: benchmarks/results/methods.md, `benchmarks.cluster.delay`.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from mdsp_base.comm import LINK_CLASSES
from mdsp_base.topology import LinkClass

from .spec import ClusterSpec

SOURCE = Path(__file__).with_name("delayline.c")
_READY_TIMEOUT_S = 10.0
# Frames queued towards the delay line before the tap drops them (tun's default is 500).
_TAP_QUEUE = 10000
_NICE = -10


def check_compiler() -> str | None:
    """Why the delay line cannot be built here, or None."""
    if shutil.which("cc") is None:
        return "a C compiler ('cc') for the delay line: install gcc (apt-get install -y gcc)"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun for the delay line's tap devices (modprobe tun)"
    return None


def _private_dir() -> Path:
    """This user's build directory, 0700: a binary the cluster runs as root must not be one another
    local user could have planted in the shared temporary directory."""
    path = Path(tempfile.gettempdir()) / f"emulated-cluster-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(
            f"{path} is not a directory of this user's with mode 0700 (another user's, a link, or open "
            "to others): remove it, or set TMPDIR to a private directory"
        )
    return path


def binary() -> Path:
    """The compiled delay line, built once per version of its source."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    path = _private_dir() / f"delayline-{digest}"
    if not path.exists():
        tmp = path.with_suffix(".build")
        proc = subprocess.run(
            ["cc", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()}")
        tmp.replace(path)  # atomic: a concurrent build never runs a half-written binary
    return path


def tap_name(prefix: str, link: LinkClass) -> str:
    """The tap carrying one link class's delayed packets (interface names have <= 15 characters)."""
    return f"{prefix}-d{LINK_CLASSES.index(link)}"


def start(spec: ClusterSpec, sw: str, prefix: str, bridge: str, sh: Callable[..., str]) -> subprocess.Popen:
    """Start the delay line in namespace ``sw`` and attach its taps to ``bridge``; ``sh`` runs one
    ip/tc command. Killing the namespace's processes (teardown) stops it; wait for it then."""
    taps = {tap_name(prefix, link): spec.latency_ms(link) for link in spec.delayed_classes()}
    argv = [f"{name}:{ms * 1000:g}" for name, ms in taps.items()]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", sw, str(binary()), *argv],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
            # Ahead of the ranks for a core: a frame released late adds to the delay on a busy host.
            preexec_fn=lambda: os.nice(_NICE),
        )  # fmt: skip
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline().strip() if sel.select(_READY_TIMEOUT_S) else None
        if line != "ready":
            proc.kill()
            proc.wait()
            err.seek(0)
            raise RuntimeError(f"the delay line did not start: {err.read().strip() or 'no ready line'}")
    for name in taps:
        sh(
            "ip",
            "-n",
            sw,
            "link",
            "set",
            name,
            "mtu",
            "9000",
            "txqueuelen",
            str(_TAP_QUEUE),
            "master",
            bridge,
        )
        # Learning off: the bridge must keep each rank's MAC on the rank's own port; flooding off:
        # nothing but the redirected packets may enter the delay line.
        sh("ip", "-n", sw, "link", "set", name, "type", "bridge_slave", "learning", "off", "flood", "off",
           "mcast_flood", "off", "bcast_flood", "off")  # fmt: skip
        sh("ip", "-n", sw, "link", "set", name, "up")

    return proc
