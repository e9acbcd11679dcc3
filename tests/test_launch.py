"""The multi-process launcher, on the CPU: ranks, fail-fast and the timeout."""

import ipaddress
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from jax_cpgrad import launch


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def test_each_rank_gets_its_coordinates(tmp_path):
    argv = _script(
        tmp_path,
        """
        from jax_cpgrad import launch
        print(f"rank={launch.rank()} of {launch.num_processes()}")
    """,
    )
    results = launch.launch(argv, 3, timeout_s=60, devices="none", echo=False)
    assert [r.returncode for r in results] == [0, 0, 0]
    assert [r.output.strip() for r in results] == [f"rank={r} of 3" for r in range(3)]


def test_jax_distributed_job_on_cpu(tmp_path):
    argv = _script(
        tmp_path,
        """
        import jax
        from jax_cpgrad import launch
        launch.initialize()
        print(f"process {jax.process_index()} of {jax.process_count()}, {len(jax.devices())} devices")
    """,
    )
    results = launch.launch(argv, 2, timeout_s=120, devices="none", echo=False)
    lines = sorted(line for r in results for line in r.output.splitlines() if line.startswith("process "))
    assert lines == ["process 0 of 2, 2 devices", "process 1 of 2, 2 devices"]


def test_first_failure_stops_the_others(tmp_path):
    argv = _script(
        tmp_path,
        """
        import sys, time
        from jax_cpgrad import launch
        if launch.rank() == 1:
            sys.exit(3)
        time.sleep(60)
    """,
    )
    with pytest.raises(launch.LaunchError, match="rank 1 exited with code 3") as info:
        launch.launch(argv, 3, timeout_s=50, devices="none", echo=False)
    codes = {r.rank: r.returncode for r in info.value.results}
    assert codes[1] == 3 and codes[0] is None and codes[2] is None


def test_timeout_kills_every_rank(tmp_path):
    argv = _script(tmp_path, "import time; time.sleep(60)\n")
    with pytest.raises(launch.LaunchError, match="timed out after 2 s"):
        launch.launch(argv, 2, timeout_s=2, devices="none", echo=False)


def test_command_line_exit_codes(tmp_path):
    ok = _script(tmp_path, "print('hi')\n")
    assert launch.main(["-n", "2", "--devices", "none", ok[1]]) == 0
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(2)\n")
    assert launch.main(["-n", "2", "--devices", "none", str(bad)]) == 1


def test_key_value_exchange_between_processes(tmp_path):
    """The helper Workspace uses to exchange public facts and agree on errors, on a CPU job."""
    argv = _script(
        tmp_path,
        """
        import jax
        from jax_cpgrad import launch, _distributed
        launch.initialize()
        me = jax.process_index()
        everyone = _distributed.exchange("test/exchange", {"rank": me, "handle": "ab" * me}, 60)
        print("GOT", everyone)
    """,
    )
    results = launch.launch(argv, 2, timeout_s=120, devices="none", echo=False)
    want = "GOT [{'rank': 0, 'handle': ''}, {'rank': 1, 'handle': 'ab'}]"
    for r in results:
        assert want in r.output, r.output[-2000:]


def _own_non_loopback_addresses() -> list[str]:
    """This machine's own IPv4/IPv6 addresses other than loopback (and link-local IPv6).

    Candidates come from the host name, `ip -o addr`, `hostname -I` and the source address of a
    route out (a UDP socket connected to a documentation address: connecting a UDP socket sends
    nothing). A candidate is kept only if a socket can bind to it, which holds for this machine's
    own addresses only, so the test never connects anywhere else.
    """
    candidates: list[str] = []
    try:
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        pass
    for cmd, pattern in (
        (["ip", "-o", "addr", "show"], r"\binet6? ([0-9a-fA-F.:]+)/"),
        (["hostname", "-I"], r"(\S+)"),
    ):
        if shutil.which(cmd[0]):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            candidates += re.findall(pattern, out)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.connect(("192.0.2.1", 9))
            candidates.append(udp.getsockname()[0])
    except OSError:
        pass
    found = []
    for text in dict.fromkeys(candidates):
        try:
            addr = ipaddress.ip_address(text)
        except ValueError:
            continue
        if addr.is_loopback or addr.is_unspecified or addr.is_link_local or addr.is_multicast:
            continue
        family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((str(addr), 0))
        except OSError:
            continue  # not one of this machine's addresses
        found.append(str(addr))
    return found


def test_coordinator_listens_on_the_loopback_only(tmp_path):
    addresses = _own_non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback address to check the coordinator against")
    argv = _script(
        tmp_path,
        """
        import os, socket
        from jax_cpgrad import launch
        launch.initialize()
        if launch.rank() == 0:
            port = int(os.environ["JAX_CPGRAD_COORDINATOR"].rsplit(":", 1)[1])
            for addr in ["127.0.0.1", *os.environ["TEST_OWN_ADDRESSES"].split(",")]:
                family = socket.AF_INET6 if ":" in addr else socket.AF_INET
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(10)
                    try:
                        s.connect((addr, port))
                        print("CONNECT", addr, "accepted", flush=True)
                    except OSError as err:
                        print("CONNECT", addr, type(err).__name__, flush=True)
    """,
    )
    results = launch.launch(
        argv, 2, timeout_s=120, devices="none", echo=False, env={"TEST_OWN_ADDRESSES": ",".join(addresses)}
    )
    outcome = dict(line.split()[1:] for line in results[0].output.splitlines() if line.startswith("CONNECT "))
    assert outcome.get("127.0.0.1") == "accepted", results[0].output[-2000:]
    for addr in addresses:
        assert outcome.get(addr) == "ConnectionRefusedError", (addr, results[0].output[-2000:])


def test_cp_training_across_two_cpu_processes(tmp_path):
    """`python -m jax_cpgrad.launch -n 2 --devices none ...`: a CP training step whose collectives
    cross the two processes (gloo), equal to the unsharded model, and every rank exits cleanly."""
    argv = _script(
        tmp_path,
        """
        import jax
        import numpy as np
        from jax.sharding import Mesh
        from jax_cpgrad import launch
        launch.initialize()
        from jax_cpgrad.models.cp_train_step import local_value, make_train_step, replicate, shard_batch
        from jax_cpgrad.models.transformer import (
            Config, init_params, reference_loss_and_grads, synthetic_batch,
        )

        cfg = Config(seq_len=256)
        mesh = Mesh(np.array(jax.devices()), ("cp",))
        params0 = init_params(cfg, seed=0)
        batches = [synthetic_batch(cfg, seed=i) for i in range(2)]
        step = make_train_step(cfg, mesh)
        params = replicate(mesh, params0)
        for i, batch in enumerate(batches):
            params, loss, _ = step(params, *shard_batch(mesh, *batch))
            print(f"step {i} loss {float(local_value(loss)):.6f}", flush=True)
        ref, _ = reference_loss_and_grads(params0, *batches[0], cfg)
        print(f"reference loss {float(ref):.6f} on {len(jax.devices())} devices", flush=True)
        launch.finish()
    """,
    )
    results = launch.launch(argv, 2, timeout_s=300, devices="none", echo=False)
    for r in results:
        lines = dict(line.rsplit(" ", 1) for line in r.output.splitlines() if line.startswith("step "))
        ref = [line for line in r.output.splitlines() if line.startswith("reference loss")]
        assert set(lines) == {"step 0 loss", "step 1 loss"}, r.output[-3000:]
        assert ref and ref[0].endswith("on 2 devices"), r.output[-3000:]
        reference = float(ref[0].split()[2])
        assert abs(float(lines["step 0 loss"]) - reference) <= 1e-4 * abs(reference), r.output[-3000:]
    assert [r.output.count("loss") for r in results] == [3, 3]


def test_a_rank_that_leaves_early_is_named_with_the_fix(tmp_path):
    """Rank 0 hosts the coordination service: when it exits (os._exit, no barrier) while rank 1 still
    runs, rank 1 is aborted; the launcher's message says what happened and what to use instead."""
    argv = _script(
        tmp_path,
        """
        import os, time
        from jax_cpgrad import launch
        launch.initialize()
        if launch.rank() == 1:
            time.sleep(60)  # aborted long before: rank 0's exit takes the coordination service along
        os._exit(0)
    """,
    )
    with pytest.raises(launch.LaunchError, match=r"rank\(s\) 0 had exited with code 0.*launch\.finish\(\)"):
        launch.launch(argv, 2, timeout_s=120, devices="none", echo=False)
