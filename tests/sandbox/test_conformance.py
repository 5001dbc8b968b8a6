"""Conformance suite of turnforge.sandbox: every guarantee is shown by an attack that must fail.

Each attack is real code run in the sandbox that prints a marker saying what happened; each test
asserts that the attack ran (its marker is there) and failed for the right reason. Network
attacks target only a listener the test starts on 127.0.0.1 of the host and assert that it saw
no connection. Controls run the same attack code where the guarantee is lifted (network shared,
or the unsafe backend) to show the attack works when not blocked.

Resource attacks (fork bomb, memory, disk, CPU) run under small limits and carry their own
safety stops, so that a broken limit fails the test without hurting the host.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from turnforge.sandbox import TRUNCATED, Sandbox

PROJECT = Path(__file__).resolve().parents[2]


def py(code: str) -> list[str]:
    """argv running ``code`` with python3 in the sandbox (its arguments follow)."""
    return ["python3", "-c", textwrap.dedent(code)]


def lines_with(text: str, marker: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(marker)]


# --- network --------------------------------------------------------------------------------

CONNECT = py("""
    import socket, sys
    print("IFACES", *sorted(name for _, name in socket.if_nameindex()))
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=3).close()
        print("CONNECTED")
    except OSError as err:
        print("BLOCKED", type(err).__name__, err.errno)
""")

SUBPROCESS_CONNECT = py("""
    import subprocess, sys
    code = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)"
    done = subprocess.run([sys.executable, "-c", code, sys.argv[1]], capture_output=True, text=True)
    print("CHILD-EXIT", done.returncode, done.stderr.strip().splitlines()[-1] if done.stderr else "")
""")

CTYPES_CONNECT = py("""
    import ctypes, socket, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    addr = struct.pack("=HH4s8x", socket.AF_INET, socket.htons(int(sys.argv[1])), socket.inet_aton("127.0.0.1"))
    rc = libc.connect(fd, ctypes.c_char_p(addr), len(addr))
    print("CTYPES-CONNECT", rc, ctypes.get_errno())
""")

SHELL_CONNECT = py("""
    import os, sys
    status = os.system(sys.argv[2].replace("PORT", sys.argv[1]) + " >/dev/null 2>&1")
    print("TOOL-EXIT", os.waitstatus_to_exitcode(status))
""")


def test_no_outbound_tcp_via_python_socket(make_sandbox, listener):
    r = make_sandbox().run([*CONNECT, str(listener.port)])
    assert lines_with(r.stdout, "IFACES") == ["IFACES lo"]  # only loopback in the sandbox's own netns
    assert "BLOCKED ConnectionRefusedError 111" in r.stdout  # its own loopback: nobody listens there
    assert listener.accepted() == 0


@pytest.mark.parametrize("attack, success", [
    ("socket", "CONNECTED"), ("ctypes", "CTYPES-CONNECT 0 0"), ("bash", "TOOL-EXIT 0"),
])
def test_control_shared_network_reaches_the_listener(make_sandbox, listener, attack, success):
    """The same attacks with Limits(network=True) connect: the harness does see a breach."""
    argv = {"socket": CONNECT, "ctypes": CTYPES_CONNECT, "bash": SHELL_CONNECT}[attack]
    r = make_sandbox(network=True).run([*argv, str(listener.port), "bash -c 'exec 3<>/dev/tcp/127.0.0.1/PORT'"])
    assert success in r.stdout, r
    assert listener.accepted() == 1


@pytest.mark.parametrize(
    "tool, command, refused_exit",
    [
        ("curl", "curl -sS --max-time 3 -o /dev/null http://127.0.0.1:PORT/", 7),  # 7: failed to connect
        ("wget", "wget -q -T 3 -t 1 -O /dev/null http://127.0.0.1:PORT/", 4),  # 4: network failure
        ("bash", "bash -c 'exec 3<>/dev/tcp/127.0.0.1/PORT'", 1),
    ],
)
def test_no_outbound_tcp_via_os_system(make_sandbox, listener, tool, command, refused_exit):
    if not Path("/usr/bin", tool).exists():
        pytest.skip(f"{tool} is not installed in /usr/bin, so not in the sandbox either")
    r = make_sandbox().run([*SHELL_CONNECT, str(listener.port), command])
    assert lines_with(r.stdout, "TOOL-EXIT") == [f"TOOL-EXIT {refused_exit}"], r
    assert listener.accepted() == 0


def test_no_outbound_tcp_via_python_subprocess(make_sandbox, listener):
    r = make_sandbox().run([*SUBPROCESS_CONNECT, str(listener.port)])
    assert lines_with(r.stdout, "CHILD-EXIT 1 ConnectionRefusedError"), r
    assert listener.accepted() == 0


def test_no_outbound_tcp_via_ctypes_libc_connect(make_sandbox, listener):
    r = make_sandbox().run([*CTYPES_CONNECT, str(listener.port)])
    assert lines_with(r.stdout, "CTYPES-CONNECT") == ["CTYPES-CONNECT -1 111"], r  # ECONNREFUSED
    assert listener.accepted() == 0


def test_no_abstract_unix_socket_to_the_host(make_sandbox, token):
    """Abstract unix sockets belong to the network namespace: the host's is out of reach."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(f"\0{token}")
    server.listen(1)
    server.setblocking(False)
    try:
        r = make_sandbox().run([*py("""
            import socket, sys
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect("\\0" + sys.argv[1])
                print("CONNECTED")
            except OSError as err:
                print("BLOCKED", type(err).__name__)
        """), token])
        assert "BLOCKED ConnectionRefusedError" in r.stdout, r
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


def test_no_dns(make_sandbox):
    r = make_sandbox().run(py("""
        import os, socket
        print("RESOLV-CONF", os.path.exists("/etc/resolv.conf"))
        try:
            print("RESOLVED", socket.getaddrinfo("example.com", 443))
        except socket.gaierror as err:
            print("DNS-FAILED", type(err).__name__)
    """))
    assert "RESOLV-CONF False" in r.stdout and "DNS-FAILED gaierror" in r.stdout, r


# --- host files -----------------------------------------------------------------------------

READ = py("""
    import os, sys
    path = sys.argv[1]
    try:
        if os.path.isdir(path):
            print("LISTED", len(os.listdir(path)))
        else:
            print("READ", open(path).read())
    except OSError as err:
        print("DENIED", type(err).__name__)
""")


@pytest.fixture()
def run_dir(tmp_path, token) -> Path:
    """A fake run directory with a checkpoint holding ``token``, like ``runs/<name>/`` of a trainer."""
    secret = tmp_path / "runs" / "exp" / "checkpoints" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text(token)
    return secret


@pytest.mark.parametrize("target", ["/etc/shadow", "home", "home-file", "project", "project-file", "run-dir", "run-file"])
def test_cannot_read_host_files(make_sandbox, run_dir, token, target):
    path = {
        "home": Path.home(), "home-file": Path.home() / ".bashrc",
        "project": PROJECT, "project-file": PROJECT / "pyproject.toml",
        "run-dir": run_dir.parents[2], "run-file": run_dir,
    }.get(target, target)
    r = make_sandbox().run([*READ, str(path)])
    assert lines_with(r.stdout, "DENIED") == ["DENIED FileNotFoundError"], r  # not even visible
    assert token not in r.stdout


def test_control_unsafe_backend_reads_the_run_dir(run_dir, token):
    with pytest.warns(UserWarning):
        sandbox = Sandbox(backend="unsafe-none")
    assert sandbox.run([*READ, str(run_dir)]).stdout.strip() == f"READ {token}"


@pytest.mark.parametrize("where", ["/usr", "/etc", "/", "/tmp", "project"])
def test_cannot_write_outside_the_work_dir(make_sandbox, token, where):
    directory = PROJECT if where == "project" else Path(where)
    target = directory / token
    try:
        r = make_sandbox().run([*py("""
            import sys
            try:
                open(sys.argv[1], "w").write("pwned")
                print("WROTE")
            except OSError as err:
                print("DENIED", type(err).__name__, err.errno)
        """), str(target)])
        expected = {"/tmp": "WROTE", "project": "DENIED FileNotFoundError 2"}.get(where, "DENIED OSError 30")  # EROFS
        assert lines_with(r.stdout, "WROTE") + lines_with(r.stdout, "DENIED") == [expected], r  # /tmp: its own
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


# --- resources ------------------------------------------------------------------------------

def test_fork_bomb_is_capped_and_ends(make_sandbox, token, survivors):
    r = make_sandbox(max_processes=16).run([*py("""
        import os, time
        failed = False
        for _ in range(7):  # every process forks again: 2**7 = 128 processes if the limit did not hold
            try:
                os.fork()
            except OSError as err:
                if not failed:
                    failed = True
                    pids = [p for p in os.listdir("/proc") if p.isdigit()]
                    print("FORK-FAILED", err.errno, len(pids), flush=True)
        time.sleep(60)
    """), token], timeout=2.0)
    failures = lines_with(r.stdout, "FORK-FAILED")
    assert failures and all(line.split()[1] == "11" for line in failures), r  # EAGAIN
    assert max(int(line.split()[2]) for line in failures) <= 16
    assert r.killed_reason == "timeout" and r.duration_s < 60  # killed at the timeout, not after its sleep
    assert survivors(token) == []
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_max_processes_is_counted_per_sandbox(make_sandbox):
    """RLIMIT_NPROC counts in each sandbox's own user namespace: concurrent sandboxes don't add up."""
    from concurrent.futures import ThreadPoolExecutor

    sandbox = make_sandbox(max_processes=8)
    spawn = ["sh", "-c", "for i in 1 2 3 4 5; do sleep 0.5 & done; wait; echo ALL-STARTED"]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: sandbox.run(spawn), range(3)))
    assert all(r.stdout == "ALL-STARTED\n" for r in results), results


@pytest.mark.parametrize("catch", [True, False])
def test_memory_bomb_is_capped(make_sandbox, catch):
    # calloc'd bytearrays are not touched: a broken limit costs address space, not host memory.
    code = """
        chunks = []
        try:
            while len(chunks) < 4096:  # a safety stop at 128 GiB of address space
                chunks.append(bytearray(32 << 20))
            print("NOT-LIMITED")
        except MemoryError:
            print("MEMORY-LIMITED", len(chunks) * 32, flush=True)
            if not CATCH:
                raise
    """
    r = make_sandbox(memory_mb=256).run(py(f"CATCH = {catch}\n" + textwrap.dedent(code)))
    got = lines_with(r.stdout, "MEMORY-LIMITED")
    assert got and int(got[0].split()[1]) <= 256, r
    assert r.killed_reason == (None if catch else "memory")


@pytest.mark.parametrize("where", [".", "/tmp", "/dev/shm"])
def test_disk_fill_hits_the_work_dir_cap(make_sandbox, where):
    r = make_sandbox(disk_mb=8).run([*py("""
        import os, sys
        block = b"x" * (1 << 20)
        for i in range(64):  # a safety stop at 64 MB
            try:
                with open(os.path.join(sys.argv[1], f"fill{i}"), "wb") as f:
                    f.write(block)
            except OSError as err:
                print("DISK-FULL", err.errno, i)
                break
        else:
            print("NOT-LIMITED")
    """), where])
    full = lines_with(r.stdout, "DISK-FULL")
    assert full and full[0].split()[1] == "28" and int(full[0].split()[2]) <= 8, r  # ENOSPC


def test_cpu_loop_is_killed_by_the_cpu_limit(make_sandbox):
    r = make_sandbox(cpu_s=1).run(py("""
        print("SPINNING", flush=True)
        while True:
            pass
    """), timeout=60.0)
    assert r.stdout == "SPINNING\n"
    assert r.killed_reason == "cpu" and r.exit_code == 152 and not r.timed_out  # 128 + SIGXCPU
    assert r.duration_s > 0.9  # at least its CPU second (wall time grows with the machine's load)


def test_sleeping_past_the_timeout_kills_every_process(make_sandbox, token, survivors):
    """A detached grandchild (own session, like a daemon) dies with the sandbox too."""
    r = make_sandbox().run([*py("""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            os.execvp("python3", ["python3", "-c", "import time; time.sleep(60)", sys.argv[1]])
        print("SLEEPING", flush=True)
        time.sleep(60)
    """), token], timeout=1.0)
    assert r.stdout == "SLEEPING\n"
    assert r.timed_out and r.killed_reason == "timeout"
    assert 1.0 <= r.duration_s < 60  # killed at the timeout, not after its sleep
    time.sleep(0.1)
    assert survivors(token) == []


def test_output_flood_is_cut(make_sandbox):
    r = make_sandbox(max_output_bytes=10_000).run(py("""
        import sys
        print("FLOODING", flush=True)
        while True:
            sys.stdout.write("x" * 65536)
    """))
    assert r.killed_reason == "output"
    assert r.stdout.startswith("FLOODING\n") and r.stdout.endswith(TRUNCATED.format(limit=10_000))
    assert len(r.stdout) == 10_000 + len(TRUNCATED.format(limit=10_000))


# --- processes, /proc, privileges, environment ------------------------------------------------

def test_cannot_kill_the_parent_or_host_processes(make_sandbox):
    r = make_sandbox().run([*py("""
        import os, signal, sys
        print("PPID", os.getppid())
        for name, pid in (("ppid", os.getppid()), ("pid1", 1), ("host", int(sys.argv[1])), ("all", -1)):
            try:
                os.kill(pid, signal.SIGKILL)
                print("KILL", name, "sent")
            except OSError as err:
                print("KILL", name, type(err).__name__)
        print("ALIVE")
    """), str(os.getpid())])
    assert "PPID 1" in r.stdout  # its parent is the sandbox's own init, not a host process
    assert "KILL host ProcessLookupError" in r.stdout, r  # host pids do not exist in there
    assert "ALIVE" in r.stdout and r.exit_code == 0  # its init ignores the SIGKILLs; bwrap carried on
    os.kill(os.getpid(), 0)  # and this process is here to tell


def test_cannot_escape_through_proc(make_sandbox):
    r = make_sandbox().run([*py("""
        import os, sys
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
        print("PIDS", len(pids))
        print("PROGRAMS", *sorted(os.path.basename(open(f"/proc/{p}/cmdline").read().split("\\0")[0]) for p in pids))
        print("ROOT", *sorted(os.listdir("/proc/1/root")))
        for path in ("/proc/1/root/etc/shadow", "/proc/self/root/etc/shadow", "/proc/1/root/root",
                     f"/proc/{sys.argv[1]}/environ", f"/proc/{sys.argv[1]}/root/etc/shadow"):
            try:
                os.listdir(path) if path.endswith("root") else open(path, "rb").read()
                print("REACHED", path)
            except OSError as err:
                print("DENIED", type(err).__name__)
        for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/core_pattern"):
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as err:
                print("DENIED-WRITE", type(err).__name__)
    """), str(os.getpid())])
    assert int(lines_with(r.stdout, "PIDS")[0].split()[1]) <= 3, r  # its init and itself
    assert lines_with(r.stdout, "PROGRAMS") == ["PROGRAMS bwrap python3"]  # no host process is visible
    assert set(lines_with(r.stdout, "ROOT")[0].split()[1:]) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sandbox", "sbin", "tmp", "usr"}
    assert lines_with(r.stdout, "DENIED ") == ["DENIED FileNotFoundError"] * 5
    assert not lines_with(r.stdout, "REACHED") and not lines_with(r.stdout, "WROTE")
    assert len(lines_with(r.stdout, "DENIED-WRITE")) == 2


def test_no_privileges_and_setuid_binaries_do_not_help(make_sandbox):
    """mount and su are setuid root on the host (unshare too on this one); no_new_privs makes
    exec ignore the bit, so they run as uid 65534 like the program."""
    assert Path("/usr/bin/mount").stat().st_mode & stat.S_ISUID, "mount is not setuid here: the attack proves less"
    r = make_sandbox().run(py("""
        import errno, os, subprocess
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines())
        for key in ("Uid", "NoNewPrivs", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            print("STATUS", key, status[key].split()[0])
        try:
            os.setuid(0)
            print("SETUID-OK")
        except OSError as err:  # EINVAL: uid 0 does not even exist in its user namespace
            print("SETUID-DENIED", errno.errorcode[err.errno])
        for cmd in (["mount", "-t", "tmpfs", "none", "/sandbox/tmp"], ["su", "-c", "id -u", "root"],
                    ["unshare", "--user", "--map-root-user", "id", "-u"]):
            done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            print("RUN", cmd[0], done.returncode, (done.stdout + done.stderr).strip().replace("\\n", " "))
    """))
    status = {line.split()[1]: line.split()[2] for line in lines_with(r.stdout, "STATUS")}
    assert status == {"Uid": "65534", "NoNewPrivs": "1", "CapInh": "0" * 16, "CapPrm": "0" * 16,
                      "CapEff": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16}, r
    assert lines_with(r.stdout, "SETUID-DENIED") in (["SETUID-DENIED EINVAL"], ["SETUID-DENIED EPERM"])
    runs = {line.split()[1]: line for line in lines_with(r.stdout, "RUN")}
    assert all(line.split()[2] != "0" for line in runs.values()), runs  # each of them failed
    assert "must be superuser" in runs["mount"]  # setuid mount still sees euid 65534
    assert "No space left on device" in runs["unshare"]  # no user namespaces inside (--disable-userns)


def test_environment_is_scrubbed(make_sandbox, monkeypatch, token):
    monkeypatch.setenv("TURNFORGE_SANDBOX_SECRET", token)
    r = make_sandbox().run(py("""
        import os
        print("KEYS", *sorted(os.environ))
        readable, found = 0, False
        for p in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                found |= b"TURNFORGE_SANDBOX_SECRET" in open(f"/proc/{p}/environ", "rb").read()
                readable += 1
            except OSError:
                pass
        print("ENVIRON-READ", readable, "SECRET-FOUND", found)
    """))
    assert lines_with(r.stdout, "KEYS") == ["KEYS HOME LANG PATH PWD PYTHONDONTWRITEBYTECODE TMPDIR"], r
    assert lines_with(r.stdout, "ENVIRON-READ")[0].endswith("SECRET-FOUND False")
    assert int(lines_with(r.stdout, "ENVIRON-READ")[0].split()[1]) >= 1  # the check could see environs
    assert token not in r.stdout + r.stderr


def test_program_cannot_fake_an_infrastructure_failure(make_sandbox):
    """Printing bwrap's error (to its own stderr and to bwrap's, via /proc/1/fd/2) and exiting
    like bwrap does is still the program's failure: a Result, not SandboxError."""
    fake = "bwrap: Creating new namespace failed: Operation not permitted"
    r = make_sandbox().run(["sh", "-c", f"echo '{fake}' >&2; echo '{fake}' >/proc/1/fd/2; exit 1"])
    assert r.exit_code == 1 and fake in r.stderr
