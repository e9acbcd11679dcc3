"""Passing workspace memory between processes, on the CPU: ordinary file descriptors stand in for
the GPU memory's, so the socket, its credentials checks and the key-value facts run for real."""

import json
import os
import re
import stat
import subprocess
import sys
import textwrap

import pytest

import intruder
from jax_cpgrad import _distributed, _memory_exchange, _peer_memory, launch

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SO_PEERCRED and SCM_RIGHTS: Linux only")

# A child that fetches from the server at argv[1] as pid argv[2] and prints what it received.
FETCH_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from jax_cpgrad import _peer_memory
    try:
        payload, fds = _peer_memory.fetch(sys.argv[1], int(sys.argv[2]), 10)
    except _peer_memory.PeerMemoryError as err:
        print("REFUSED " + str(err))
        raise SystemExit(0)
    contents = [os.pread(fd, 100, 0).decode() for fd in fds]
    print("GOT " + json.dumps({"payload": payload, "contents": contents}))
    """
)


def _files(tmp_path, *texts):
    """Descriptors of files holding `texts` (stand-ins for exported GPU memory)."""
    fds = []
    for i, text in enumerate(texts):
        path = tmp_path / f"memory{i}"
        path.write_text(text)
        fds.append(os.open(path, os.O_RDONLY))
    return fds


def _child(*argv):
    return subprocess.Popen(
        [sys.executable, "-c", FETCH_CHILD, *map(str, argv)], stdout=subprocess.PIPE, text=True
    )


def test_descriptors_reach_a_process_of_the_job(tmp_path):
    fds = _files(tmp_path, "header bytes", "slot bytes")
    with _peer_memory.MemoryServer(fds, {"devices": [[3, 1, 2]]}) as server:
        st = os.stat(server.directory)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        child = _child(server.path, os.getpid())
        server.serve([child.pid])
        out, _ = child.communicate(timeout=60)
        directory, path = server.directory, server.path
    got = json.loads(out.split("GOT ", 1)[1])
    assert got == {"payload": {"devices": [[3, 1, 2]]}, "contents": ["header bytes", "slot bytes"]}
    assert server.refused == [] and server.errors == []
    assert not os.path.exists(path) and not os.path.exists(directory)
    for fd in fds:  # the server closed its descriptors
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_process_outside_the_job_is_refused_and_named(tmp_path):
    fds = _files(tmp_path, "secret", "secret")
    with _peer_memory.MemoryServer(fds, {"devices": []}) as server:
        server.serve([os.getpid() + 1_000_000])  # the job's pids: not the intruder's
        intruder = _child(server.path, os.getpid())
        out, _ = intruder.communicate(timeout=60)
    assert out.startswith("REFUSED "), out
    assert "without sending its memory" in out and "secret" not in out
    assert server.refused == [(intruder.pid, os.getuid())]


def test_the_fetcher_refuses_a_server_that_is_not_the_published_process(tmp_path):
    fds = _files(tmp_path, "a", "b")
    with _peer_memory.MemoryServer(fds, {"devices": []}) as server:
        server.serve([os.getpid()])
        with pytest.raises(_peer_memory.PeerMemoryError, match=f"served by pid {os.getpid()}"):
            _peer_memory.fetch(server.path, os.getpid() + 1, 10)


def test_another_user_knowing_the_facts_gets_nothing(tmp_path):
    """Root only: a second user's process that knows the published facts tries the socket,
    /proc/PID/fd and pidfd_getfd and gets nothing; with the socket's directory opened to everyone
    (as if that protection failed), the credentials check refuses it and names it."""
    try:
        user = intruder.ensure_user()
    except LookupError as why:
        pytest.skip(str(why))
    fds = _files(tmp_path, "secret", "secret")
    with _peer_memory.MemoryServer(fds, {"devices": []}) as server:
        server.serve([os.getpid()])
        facts = [{"host": "h", "pid": os.getpid(), "socket": server.path, "devices": []}]
        closed = intruder.run_as(user, facts)
        os.chmod(server.directory, 0o755)
        os.chmod(server.path, 0o777)
        opened = intruder.run_as(user, facts)
    if "could_not_run" in closed:
        pytest.skip(f"cannot run a process as {user} here: {closed['could_not_run']}")
    tried = closed["attempts"]["0"]
    assert closed["uid"] != os.getuid()
    assert tried["socket"] == {"connected": False, "error": "EACCES"}
    assert not tried["proc_fd"]["listed"] and not tried["pidfd_getfd"].get("fds"), tried
    assert opened["attempts"]["0"]["socket"] == {"connected": True, "bytes": 0, "fds": []}
    assert closed["obtained_fds"] == opened["obtained_fds"] == 0
    assert server.refused == [(opened["pid"], opened["uid"])]


def test_a_missing_socket_is_a_clear_error(tmp_path):
    with pytest.raises(_peer_memory.PeerMemoryError, match="fetching memory from .*nowhere.sock failed"):
        _peer_memory.fetch(str(tmp_path / "nowhere.sock"), 1, 5)


def test_a_socket_path_too_long_is_a_clear_error(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    monkeypatch.setenv("TMPDIR", str(deep))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(_peer_memory.PeerMemoryError, match="longer than a Unix socket allows"):
        _peer_memory.MemoryServer([], {})
    assert list(deep.iterdir()) == []  # nothing left behind


def test_the_private_parent_is_used_only_when_private(tmp_path, monkeypatch):
    mine = tmp_path / "run"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(mine))
    assert _peer_memory._private_parent() == str(mine)
    os.chmod(mine, 0o755)
    assert _peer_memory._private_parent() is None


GOOD = {"host": "h", "pid": 42, "socket": "/run/user/1/jax_cpgrad-x/memory.sock", "devices": [2, 3]}


@pytest.mark.parametrize(
    "entry,named",
    [
        (["not", "an", "object"], "a list, not an object"),
        ({**GOOD, "pid": "42"}, "pid '42'"),
        ({**GOOD, "pid": True}, "pid True"),
        ({**GOOD, "pid": -1}, "pid -1"),
        ({**GOOD, "host": ""}, "host ''"),
        ({**GOOD, "socket": "relative.sock"}, "socket path 'relative.sock'"),
        ({k: v for k, v in GOOD.items() if k != "socket"}, "socket path None"),
        ({**GOOD, "devices": [2]}, "devices [2], but the mesh gives it [2, 3]"),
        ({**GOOD, "devices": ["2", 3]}, "devices"),
    ],
)
def test_bogus_facts_are_named(entry, named):
    with pytest.raises(RuntimeError, match="process 1's entry 'k/peers'") as err:
        _memory_exchange.check_facts("k/peers", 1, entry, {2, 3})
    assert named in str(err.value) and "truncated" in str(err.value)


def test_good_facts_pass():
    assert _memory_exchange.check_facts("k", 0, GOOD, {2, 3}) is GOOD


def test_truncated_store_entries_are_named():
    raw = json.dumps(GOOD).encode()[:20]
    with pytest.raises(RuntimeError, match=r"process 3's entry 'k/3' .* not JSON .*20 bytes.*truncated"):
        _distributed._decode("k", 3, raw)
    with pytest.raises(RuntimeError, match="not JSON"):
        _distributed._decode("k", 3, b"\xff\xfe")


@pytest.mark.parametrize(
    "payload,fds",
    [
        ({"devices": [[2, 4096, 8192]]}, [10]),  # one descriptor short
        ({"devices": [[2, 4096, -1]]}, [10, 11]),
        ({"devices": [[5, 4096, 8192]]}, [10, 11]),  # another device
        (["devices"], []),
    ],
)
def test_an_answer_that_does_not_describe_the_peer_is_refused(payload, fds):
    with pytest.raises(_peer_memory.PeerMemoryError, match="does not describe its devices"):
        _memory_exchange._regions(payload, fds, {2})


# A CPU job whose "workspace memory" is one file per device: every process maps (reads) its peer's
# memory through the exchange. RANK_CORRUPTS (if set) publishes a bad entry instead of its facts.
EXCHANGE_JOB = textwrap.dedent(
    """
    import json, os, tempfile
    import jax
    from jax_cpgrad import launch, _distributed, _memory_exchange
    launch.initialize()
    me = jax.process_index()
    corrupt = os.environ.get("RANK_CORRUPTS", "")

    class FakeNative:
        def export_memory(self):
            out = []
            for d in jax.local_devices():
                fd, path = tempfile.mkstemp()
                os.unlink(path)
                os.write(fd, f"memory of device {d.id}".encode())
                out.append((os.dup(fd), 4096, fd, 8192))
            return out

    if corrupt == str(me):
        real_publish = _distributed.publish
        def publish(key, value):
            if key.endswith("/peers"):
                raw = json.dumps(value).encode()
                bogus = json.dumps({**value, "pid": "x"}).encode()
                bad = raw[: len(raw) // 2] if os.environ["CORRUPTION"] == "truncated" else bogus
                _distributed._client().key_value_set_bytes(f"{key}/{me}", bad)
            else:
                real_publish(key, value)
        _distributed.publish = publish
    try:
        with _memory_exchange.MemoryExchange(
            FakeNative(), "job/ws0", "ws", jax.local_devices(), jax.devices(), 30
        ) as ex:
            peer = next(d for d in jax.devices() if d.process_index != me)
            header_fd, header_bytes, slots_fd, slots_bytes = ex.memory_of(peer.id)
            print("READ", peer.id, os.pread(slots_fd, 100, 0).decode(), header_bytes, slots_bytes, flush=True)
            _distributed.barrier("fetched", 30)
        print("DONE", flush=True)
    except RuntimeError as err:
        print("ERROR", err, flush=True)
    """
)


def _exchange_job(tmp_path, **env):
    path = tmp_path / "exchange_job.py"
    path.write_text(EXCHANGE_JOB)
    results = launch.launch(
        [sys.executable, str(path)], 2, timeout_s=120, devices="none", env=env, echo=False
    )
    return [r.output for r in results]


def test_processes_of_a_job_map_each_others_memory(tmp_path):
    outputs = _exchange_job(tmp_path)
    for out in outputs:  # each read the file its peer exported for its device (ids vary by jax)
        assert re.search(r"READ (\d+) memory of device \1 4096 8192", out), out[-2000:]
        assert "DONE" in out, out[-2000:]
    assert outputs[0].split()[1] != outputs[1].split()[1]


@pytest.mark.parametrize("corruption", ["truncated", "bogus"])
def test_a_bad_store_entry_stops_every_process_with_the_same_clear_error(tmp_path, corruption):
    outputs = _exchange_job(tmp_path, RANK_CORRUPTS="1", CORRUPTION=corruption)
    want = "not JSON" if corruption == "truncated" else "pid 'x'"
    for out in outputs:
        assert "ERROR jax_cpgrad: process 1's entry 'job/ws0/peers" in out, out[-2000:]
        assert want in out and "READ" not in out, out[-2000:]
