"""Passing a workspace's GPU memory between the processes of one host, and only to them.

A process exports its memory as file descriptors (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``)
and serves them on a Unix-domain socket in a directory only its user can open (mode 0700). A peer
receives them with ``SCM_RIGHTS``; each side checks the other's ``SO_PEERCRED``: the same user,
and a process id among the job's. The key-value store carries only public facts (host, pid,
socket path, devices), never a capability: knowing them maps nothing. docs/peer-memory.md says
what is shared with whom.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import tempfile
import threading

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PAYLOAD = 1 << 16
_MAX_FDS = 2 * 64  # header and slots per device, far more devices than one host has
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, less its terminating NUL


class PeerMemoryError(RuntimeError):
    """Passing memory between two processes failed; the message names the process and why."""


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket, from the kernel."""
    pid, uid, _gid = _CREDENTIALS.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    )
    return pid, uid


def _private_parent() -> str | None:
    """$XDG_RUNTIME_DIR when it is this user's own directory that no one else can open, else the
    default temporary directory (the socket's own directory is private either way)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base:
        return None
    try:
        st = os.stat(base)
    except OSError:
        return None
    private = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
    return base if private else None


def _sandbox_error(what: str, err: OSError) -> PeerMemoryError:
    return PeerMemoryError(
        f"jax_cpgrad: cannot {what} ({type(err).__name__}: {err}). Ranks in several processes pass "
        "their workspace memory over a Unix-domain socket with SCM_RIGHTS and SO_PEERCRED; where the "
        "system forbids that (some sandboxes do), use one process for all GPUs, or call "
        "grad_return/all_gather without a workspace (the XLA transport)."
    )


class MemoryServer:
    """Serves this process's exported memory (``fds``, described by ``payload``) to the processes
    whose pids are allowed, from a fresh private directory. Listening starts at once (so that the
    path can be published); answering starts with :meth:`serve`. A refused connection is recorded
    in ``refused`` as (pid, uid) and never answered."""

    def __init__(self, fds: list[int], payload: dict, backlog: int = 64):
        self._fds = list(fds)
        self._payload = json.dumps(payload).encode()
        self._allowed: frozenset[int] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refused: list[tuple[int, int]] = []
        self.errors: list[str] = []
        try:
            self.directory = tempfile.mkdtemp(prefix="jax_cpgrad-", dir=_private_parent())
        except OSError as err:
            raise _sandbox_error("create a private directory for the workspace's socket", err) from err
        self.path = os.path.join(self.directory, "memory.sock")
        self._sock: socket.socket | None = None
        try:
            if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
                raise PeerMemoryError(
                    f"jax_cpgrad: the socket path {self.path!r} is longer than a Unix socket allows "
                    f"({_SUN_PATH_MAX} bytes): set TMPDIR (or XDG_RUNTIME_DIR) to a shorter directory"
                )
            st = os.stat(self.directory)  # mkdtemp makes it 0700 and ours; never serve otherwise
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PeerMemoryError(f"jax_cpgrad: {self.directory} is not private to this user")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(self.path)
            self._sock.listen(backlog)
            self._sock.settimeout(0.1)  # the accept loop looks at the stop flag this often
        except OSError as err:
            self.close()
            raise _sandbox_error("listen on a Unix-domain socket", err) from err
        except BaseException:
            self.close()
            raise

    def serve(self, allowed_pids) -> None:
        """Answer connections from these pids (of this user) until :meth:`close`."""
        self._allowed = frozenset(int(p) for p in allowed_pids)
        self._thread = threading.Thread(target=self._loop, name="jax_cpgrad-memory-server", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as err:
                if not self._stop.is_set():
                    self.errors.append(f"accept failed: {err}")
                return
            with conn:
                try:
                    pid, uid = peer_credentials(conn)
                    if uid != os.getuid() or pid not in self._allowed:
                        self.refused.append((pid, uid))
                        continue
                    conn.settimeout(10)
                    socket.send_fds(conn, [self._payload], self._fds)
                except OSError as err:
                    self.errors.append(f"answering a connection failed: {err}")

    def close(self) -> None:
        """Stop serving; close the socket and the exported descriptors; remove the directory."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for remove, path in ((os.unlink, self.path), (os.rmdir, self.directory)):
            try:
                remove(path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> MemoryServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch(path: str, expected_pid: int, timeout_s: float) -> tuple[dict, list[int]]:
    """(payload, descriptors) served at ``path`` by process ``expected_pid`` of this user. The
    caller owns the descriptors. Raises PeerMemoryError saying what went wrong."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            pid, uid = peer_credentials(sock)
            if uid != os.getuid() or pid != expected_pid:
                raise PeerMemoryError(
                    f"{path} is served by pid {pid} (uid {uid}), not by the job's pid {expected_pid} "
                    f"(uid {os.getuid()}): refusing its memory"
                )
            msg, fds, flags, _ = socket.recv_fds(sock, _MAX_PAYLOAD, _MAX_FDS)
            try:
                if flags & socket.MSG_CTRUNC:
                    raise PeerMemoryError("more descriptors were sent than a workspace has")
                if not msg:
                    raise PeerMemoryError(
                        f"pid {expected_pid} closed the connection without sending its memory "
                        "(it refused this process; see its warnings)"
                    )
                while chunk := sock.recv(_MAX_PAYLOAD):  # the rest of the payload, if any
                    msg += chunk
                payload = json.loads(msg)
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
    except PeerMemoryError:
        raise
    except (OSError, ValueError) as err:  # ValueError: the payload was not JSON
        raise PeerMemoryError(f"fetching memory from {path} failed ({type(err).__name__}: {err})") from err
    return payload, fds
