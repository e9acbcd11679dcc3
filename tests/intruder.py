"""A process of another user that knows everything a workspace published in the key-value store
(argv[1]: the facts as JSON) and tries every way it has to the workspace's memory: the ranks'
sockets, their open descriptors (/proc/PID/fd, pidfd_getfd). Prints one line, INTRUDER {json},
saying what each attempt got. Standard library only: it runs as a user who cannot read the
checkout. If it ever receives a descriptor it tries to map it with the CUDA driver.

The tests (root) use ensure_user() and run_as() to start it.
"""

import ctypes
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

USER = "cpgrad_intruder"

SYS_PIDFD_GETFD = 438  # x86_64 and aarch64


def _errno_name(err: OSError) -> str:
    return errno.errorcode.get(err.errno or 0, str(err))


def try_socket(path: str) -> dict:
    """Connect and wait for the memory a rank would send to one of its peers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 256)
    except OSError as err:
        return {"connected": False, "error": _errno_name(err)}
    return {"connected": True, "bytes": len(msg), "fds": fds}


def try_proc_fds(pid: int) -> dict:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError as err:
        return {"listed": False, "error": _errno_name(err)}
    opened = []
    for name in names:
        try:
            opened.append(os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY))
        except OSError:
            pass
    return {"listed": True, "fds": opened}


def try_pidfd_getfd(pid: int) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:
        return {"pidfd": False, "error": _errno_name(err)}
    got, errors = [], set()
    for target in range(3, 128):
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
        if fd >= 0:
            got.append(fd)
        else:
            errors.add(errno.errorcode.get(ctypes.get_errno(), "?"))
    os.close(pidfd)
    return {"pidfd": True, "fds": got, "errors": sorted(errors)}


def try_map(fds: list[int]) -> list[str]:
    """What the CUDA driver says to importing each descriptor as workspace memory."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        return [f"no libcuda: {err}"]
    cuda.cuInit(0)
    out = []
    for fd in fds:
        handle = ctypes.c_ulonglong(0)
        res = cuda.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), 1)
        out.append("imported" if res == 0 else f"CUresult {res}")
    return out


def main() -> None:
    with open(sys.argv[1]) as f:
        facts = json.load(f)
    report: dict = {"pid": os.getpid(), "uid": os.getuid(), "attempts": {}}
    obtained: list[int] = []
    for p, entry in enumerate(facts):
        attempt = {
            "socket": try_socket(entry["socket"]),
            "proc_fd": try_proc_fds(entry["pid"]),
            "pidfd_getfd": try_pidfd_getfd(entry["pid"]),
        }
        for a in attempt.values():
            obtained += a.get("fds", [])
        report["attempts"][str(p)] = attempt
    report["obtained_fds"] = len(obtained)
    report["mapped"] = try_map(obtained) if obtained else []
    print("INTRUDER " + json.dumps(report), flush=True)


def ensure_user() -> str:
    """The second local user, created with useradd when missing; raises LookupError saying why
    there can be none here (not root, no useradd or runuser, useradd refused)."""
    if os.geteuid() != 0:
        raise LookupError("the security tests add a second user and run a process as it: they need root")
    for tool in ("useradd", "runuser"):
        if shutil.which(tool) is None:
            raise LookupError(f"the security tests need {tool}, which this machine lacks")
    if subprocess.run(["id", "-u", USER], capture_output=True).returncode != 0:
        made = subprocess.run(["useradd", "-M", USER], capture_output=True, text=True)
        if made.returncode != 0:
            raise LookupError(f"useradd {USER} failed: {made.stderr.strip()}")
    return USER


def run_as(user: str, facts: list) -> dict:
    """This script's report, run as `user` with `facts`, or {"could_not_run": why}."""
    tmp = tempfile.mkdtemp(prefix="cpgrad-intruder-")
    try:
        os.chmod(tmp, 0o755)
        script = shutil.copy(os.path.abspath(__file__), os.path.join(tmp, "intruder.py"))
        facts_path = os.path.join(tmp, "facts.json")
        with open(facts_path, "w") as f:
            json.dump(facts, f)
        for path in (script, facts_path):
            os.chmod(path, 0o644)
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        proc = subprocess.run(
            ["runuser", "-u", user, "--", python, "-I", script, facts_path],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("INTRUDER "):
            return json.loads(line[len("INTRUDER ") :])
    return {"could_not_run": f"exit {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-1500:]}"}


if __name__ == "__main__":
    main()
