"""Run R JAX processes on one host, one per CP rank.

    python -m jax_cpgrad.launch -n 4 [--timeout 600] [--devices auto|share|per-rank|none] script.py [args...]

Each rank runs ``script.py`` with a local coordinator, whose service listens on the loopback
address only; the script calls ``jax_cpgrad.launch.initialize()`` (instead of
``jax.distributed.initialize``). Output lines are prefixed with the rank. The first rank that
fails stops the others, and so does the timeout: a protocol bug shows up as a hang, and a hang
must never outlive the launcher.

``--devices auto`` (the default) picks ``per-rank`` (GPU r for rank r) where there are at least as
many GPUs as ranks, ``share`` where there are fewer, and ``none`` where there is no GPU.

With ``--devices share`` every rank uses GPU 0: the processes time-slice one GPU. That tests
correctness of the multi-process peer transport (GPU memory shared between the processes) but says
nothing about NVLink speed. NCCL refuses to run in that mode, so use the numpy oracle there, not
XLA collectives.

With ``--devices none`` each rank runs on the CPU, one CPU device per process, with XLA's CPU
collectives between the processes (gloo). A rank must not exit while a computation that talks to
the other ranks is still queued (JAX dispatches asynchronously): wait for the last step's results
on every rank, or end with ``jax_cpgrad.launch.finish()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

_ENV_COORDINATOR = "JAX_CPGRAD_COORDINATOR"
_ENV_NUM = "JAX_CPGRAD_NUM_PROCESSES"
_ENV_RANK = "JAX_CPGRAD_PROCESS_ID"
_ENV_DEVICE = "JAX_CPGRAD_LOCAL_DEVICE"
DEVICE_CHOICES = ("auto", "share", "per-rank", "none")  # --devices, launch(devices=...)


def initialize() -> None:
    """Join the launcher's job: ``jax.distributed.initialize`` with this rank's coordinates."""
    import jax

    if _ENV_COORDINATOR not in os.environ:
        raise RuntimeError("jax_cpgrad.launch.initialize() must run under `python -m jax_cpgrad.launch`")
    device = os.environ.get(_ENV_DEVICE)
    coordinator = os.environ[_ENV_COORDINATOR]
    if not device and jax.config.values.get("jax_cpu_collectives_implementation", "gloo") in ("none", ""):
        # CPU ranks: collectives between the processes over gloo (already the default of recent
        # jax; set before the backend starts, in every rank).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ[_ENV_NUM]),
        process_id=int(os.environ[_ENV_RANK]),
        local_device_ids=[int(device)] if device not in (None, "") else None,
        # Rank 0's coordination service listens where the ranks connect, the launcher's loopback
        # address, and nowhere else (JAX's default binds every interface: "[::]:port").
        coordinator_bind_address=coordinator,
    )


def finish(code: int = 0, timeout_s: float = 600.0) -> None:
    """End this rank: wait for every computation it has queued (the other ranks may need its part
    of a collective), then for every other rank to get here (rank 0 hosts the coordination
    service: leaving first would kill the others), flush the output, and exit."""
    import jax

    from . import _distributed

    try:
        for array in jax.live_arrays():
            array.block_until_ready()
        jax.effects_barrier()
    except Exception:  # a computation that failed raised where it ran: leave all the same
        pass
    if jax.process_count() > 1:
        key = "jax_cpgrad/launch/finish"
        _distributed.publish(key, dict(host=socket.gethostname(), pid=os.getpid()))
        _distributed.barrier(key, timeout_s)
        if jax.process_index() == 0:  # the service's host leaves last
            _wait_for_the_others(_distributed.collect(key, timeout_s)[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_the_others(ranks: list[dict], timeout_s: float = 10.0) -> None:
    """Until the other ranks' processes have exited: one still running when the coordination
    service goes away aborts (its client's error poll), whatever it was about to do. Ranks of this
    host are watched by pid (a zombie counts as gone); for ranks elsewhere, a second's grace."""
    here = socket.gethostname()
    pids = [r["pid"] for r in ranks if r["host"] == here]
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.005)
    if any(r["host"] != here for r in ranks):
        time.sleep(1.0)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def rank() -> int:
    """This process's rank in the launched job (0 outside one)."""
    return int(os.environ.get(_ENV_RANK, "0"))


def num_processes() -> int:
    """The launched job's number of ranks (1 outside one)."""
    return int(os.environ.get(_ENV_NUM, "1"))


@dataclasses.dataclass
class RankResult:
    """One rank's end: its exit code and its whole output."""

    rank: int
    returncode: int | None  # None: killed by the launcher (another rank failed, or timeout)
    output: str


class LaunchError(RuntimeError):
    """A rank failed or the job timed out; ``results`` holds every rank's :class:`RankResult`."""

    def __init__(self, message: str, results: list[RankResult]):
        super().__init__(message)
        self.results = results


def visible_gpu_count() -> int:
    """GPUs this host shows (without initializing CUDA in the launcher)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(count, len(visible.split(","))) if visible else count


def ranks_share_gpu() -> bool:
    """Inside a launched job: do the ranks share one GPU (fewer GPUs than ranks)?"""
    return num_processes() > 1 and visible_gpu_count() < num_processes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(
    argv: list[str],
    n: int,
    *,
    timeout_s: float = 600.0,
    devices: str = "auto",
    env: dict | None = None,
    echo: bool = True,
) -> list[RankResult]:
    """Run ``argv`` as ``n`` ranks (processes); return each rank's result, or raise LaunchError on
    failure or timeout. ``devices``: one of DEVICE_CHOICES, as ``--devices``; ``env``: added to
    every rank's environment; ``echo``: print every rank's output, prefixed with its rank."""
    if n < 1:
        raise ValueError("n must be >= 1")
    if devices not in DEVICE_CHOICES:
        raise ValueError(f"devices must be one of {DEVICE_CHOICES}, got {devices!r}")
    gpus = visible_gpu_count()
    if devices == "auto":
        devices = "none" if gpus == 0 else ("per-rank" if gpus >= n else "share")
    if devices == "share" and echo and n > 1:
        print(
            f"[launch] {n} ranks share GPU 0 (time-sliced): timings say nothing about NVLink", file=sys.stderr
        )
    coordinator = f"127.0.0.1:{_free_port()}"
    procs, outputs, readers = [], [], []
    for r in range(n):
        rank_env = dict(os.environ, **(env or {}))
        rank_env.update(
            {_ENV_COORDINATOR: coordinator, _ENV_NUM: str(n), _ENV_RANK: str(r), "PYTHONUNBUFFERED": "1"}
        )
        rank_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        rank_env.setdefault("NCCL_NVLS_ENABLE", "0")
        rank_env[_ENV_DEVICE] = {"share": "0", "per-rank": str(r)}.get(devices, "")
        if devices == "none":
            rank_env.setdefault("JAX_PLATFORMS", "cpu")  # CPU ranks even where there are GPUs
        proc = subprocess.Popen(
            argv,
            env=rank_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        procs.append(proc)
        lines: list[str] = []
        outputs.append(lines)

        def pump(stream=proc.stdout, lines=lines, r=r):
            for line in stream:
                lines.append(line)
                if echo:
                    sys.stdout.write(f"[rank {r}] {line}")
                    sys.stdout.flush()

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        readers.append(thread)

    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                failure = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout_s:.0f} s"
                break
            time.sleep(0.05)
        else:
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                failure = f"rank {failed[0]} exited with code {procs[failed[0]].returncode}"
    finally:
        killed = {r for r, p in enumerate(procs) if p.poll() is None}
        for p in procs:
            _kill(p)
        for p in procs:
            p.wait()
        for t in readers:
            t.join(timeout=5)
    results = [
        RankResult(r, None if r in killed else p.returncode, "".join(outputs[r])) for r, p in enumerate(procs)
    ]
    if failure:
        left = [r.rank for r in results if r.returncode == 0]
        if left:
            # The usual cause: a rank that exits while another still needs it (rank 0 hosts the
            # coordination service; a queued collective needs every rank).
            failure += (
                f" after rank(s) {', '.join(map(str, left))} had exited with code 0 while the others were "
                "still running: end rank scripts with jax_cpgrad.launch.finish(), which waits for the "
                "rank's queued work and for every other rank before exiting"
            )
        raise LaunchError(f"jax_cpgrad.launch: {failure}", results)
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_cpgrad.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True, help="ranks, one process each")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before every rank is killed")
    parser.add_argument(
        "--devices",
        choices=DEVICE_CHOICES,
        default="auto",
        help="per-rank (GPU r for rank r), share (all on GPU 0), none (one CPU device each), "
        "auto (per-rank, share or none, by the GPUs there are)",
    )
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def main(args: list[str] | None = None) -> int:
    """``python -m jax_cpgrad.launch``: exit code 0, 1 (a rank failed) or 124 (the timeout)."""
    opts = _parser().parse_args(args)
    argv = [sys.executable, opts.script, *opts.script_args]
    try:
        launch(argv, opts.num_processes, timeout_s=opts.timeout, devices=opts.devices)
    except LaunchError as err:
        print(err, file=sys.stderr)
        return 124 if "timed out" in str(err) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
