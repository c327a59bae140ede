"""holmes_jax.launch: environment per process, rank-prefixed output, failure and Ctrl-C handling."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from holmes_jax import launch
from helpers import REPO, killed_on_exit, run_module


def test_each_process_gets_its_rank_coordinator_devices_and_nic():
    script = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ('HOLMES_COORDINATOR', "
              "'HOLMES_NUM_PROCESSES', 'HOLMES_PROCESS_ID', 'HOLMES_CPU_DEVICES', 'JAX_NUM_CPU_DEVICES', "
              "'HOLMES_NIC_CLASS', 'EXTRA')}))")
    r = run_module("holmes_jax.launch", "-n", "2", "--devices-per-process", "3", "--port", "29123",
                   "--nic-classes", "infiniband,roce", "--env", "EXTRA=a=b", "--", sys.executable, "-c", script)
    assert r.returncode == 0, r.stderr
    seen = {}
    for line in r.stdout.splitlines():
        prefix, _, body = line.partition("] ")
        seen[prefix + "]"] = json.loads(body)
    assert seen == {
        f"[rank {i}]": {"HOLMES_COORDINATOR": "127.0.0.1:29123", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": str(i),
                        "HOLMES_CPU_DEVICES": "3", "JAX_NUM_CPU_DEVICES": "3", "HOLMES_NIC_CLASS": nic, "EXTRA": "a=b"}
        for i, nic in enumerate(("infiniband", "roce"))
    }


# Whether a 64 MiB malloc, in the main thread and in another, comes from the brk heap (below the
# program break) rather than from a fresh mmap: what glibc does with the launcher's CPU tunables.
HEAP_SCRIPT = """
import ctypes, json, threading
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, ctypes.c_void_p, [ctypes.c_long]
libc.free.argtypes = [ctypes.c_void_p]
out = {}
def alloc(key):
    a = libc.malloc(64 << 20)
    out[key] = a < libc.sbrk(0)
    libc.free(a)
alloc("main")
t = threading.Thread(target=alloc, args=("thread",))
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.parametrize("devices, user_tunables, on_heap", [
    ("1", None, True),  # CPU processes: big buffers stay on the heap, also from other threads
    (None, None, False),  # no CPU devices asked: glibc's defaults (mmap)
    ("1", "glibc.malloc.arena_max=2", False),  # the user's own tunables win
])
def test_cpu_processes_keep_big_buffers_on_the_heap(devices, user_tunables, on_heap):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if user_tunables:
        env["GLIBC_TUNABLES"] = user_tunables
    args = ["-n", "1"] + (["--devices-per-process", devices] if devices else [])
    r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", *args, "--", sys.executable, "-c", HEAP_SCRIPT],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.partition("] ")[2]) == {"main": on_heap, "thread": on_heap}


def test_output_is_prefixed_line_by_line_on_both_streams():
    script = "import os, sys; r = os.environ['HOLMES_PROCESS_ID']; print('out', r); print('one\\ntwo', r, file=sys.stderr)"
    r = run_module("holmes_jax.launch", "-n", "3", "--", sys.executable, "-c", script)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] out {i}" for i in range(3)]
    assert sorted(r.stderr.splitlines()) == sorted([f"[rank {i}] one" for i in range(3)] + [f"[rank {i}] two {i}" for i in range(3)])


def test_gloos_line_for_every_connected_context_is_left_out_and_a_shortfall_shown():
    # gloo prints one such line per context and process: dozens in a run's console
    connected = "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    short = "[Gloo] Rank 0 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3"
    script = f"print({connected!r}); print({short!r}); print('step 1')"
    r = run_module("holmes_jax.launch", "-n", "1", "--", sys.executable, "-c", script)
    assert r.returncode == 0 and r.stdout.splitlines() == [f"[rank 0] {short}", "[rank 0] step 1"], r.stdout


def test_gloos_connected_lines_written_into_each_other_are_left_out_too():
    # Two of gloo's threads wrote into one line; these showed although no peer was missing.
    expected = "Expected number of connected peer ranks is : "
    garbled = [f"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. {expected}1",
               f"1 is connected to 1 peer ranks. {expected}1",
               f"[Gloo] Rank 3 is connected to 2 peer ranks. {expected}[Gloo] Rank 0 is connected to 1 peer ranks. "
               f"{expected}1"]
    assert all(launch.gloo_connected(line) for line in garbled)
    shown = [f"[Gloo] Rank [Gloo] Rank 0 is connected to 0 peer ranks. {expected}1", "7", "", "step 1 is connected",
             f"[Gloo] Rank 0 is connected to 1 peer ranks. {expected}1 and more"]
    assert not any(launch.gloo_connected(line) for line in shown)


def _exit_once_rank_0_is_ready(status: int) -> str:
    """Script lines for rank 1: exit with `status` once rank 0 has made the file $READY, so that
    its failure never overtakes rank 0's start (a fixed sleep did on a loaded machine); 9 if
    rank 0 never does."""
    return ("for _ in range(600):\n"
            f"    if os.path.exists(os.environ['READY']): sys.exit({status})\n"
            "    time.sleep(0.1)\n"
            "sys.exit(9)\n")


def test_a_failing_process_stops_the_others_and_sets_the_status(tmp_path):
    script = ("import os, sys, time; r = int(os.environ['HOLMES_PROCESS_ID']); print('started', r, flush=True)\n"
              "if r == 0: open(os.environ['READY'], 'w').close(); time.sleep(300)\n"
              + _exit_once_rank_0_is_ready(3))
    t = time.monotonic()
    r = run_module("holmes_jax.launch", "-n", "2", "--grace", "2", "--env", f"READY={tmp_path / 'ready'}", "--",
                   sys.executable, "-c", script, timeout=60)
    assert r.returncode == 3
    assert time.monotonic() - t < 60
    assert "[rank 0] started 0" in r.stdout and "[rank 1] started 1" in r.stdout
    assert "rank 1 exited with status 3; stopping the others" in r.stderr


def test_a_process_killed_by_a_signal_is_named_with_its_signal():
    # what the OOM killer does: the message said "exited with status 137"
    script = ("import os, signal, time\n"
              "if os.environ['HOLMES_PROCESS_ID'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
              "time.sleep(300)")
    r = run_module("holmes_jax.launch", "-n", "2", "--grace", "1", "--", sys.executable, "-c", script, timeout=60)
    assert r.returncode == 128 + signal.SIGKILL
    assert "launch: rank 1 was killed by SIGKILL (status 137); stopping the others" in r.stderr.splitlines()


def test_a_lone_process_killed_by_a_signal_is_named_and_one_that_failed_is_left_to_say_why():
    killed = run_module("holmes_jax.launch", "-n", "1", "--", sys.executable, "-c",
                        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", timeout=60)
    assert killed.returncode == 128 + signal.SIGKILL
    assert killed.stderr.splitlines() == ["launch: rank 0 was killed by SIGKILL (status 137)"], killed.stderr
    failed = run_module("holmes_jax.launch", "-n", "1", "--", sys.executable, "-c", "raise SystemExit(3)", timeout=60)
    assert failed.returncode == 3 and failed.stderr == "", failed.stderr


def test_sigterm_is_followed_by_sigkill_after_the_grace_period(tmp_path):
    # rank 0 ignores SIGTERM (before rank 1 fails: a slow start made it die of the SIGTERM, and the
    # test passed without a SIGKILL); only SIGKILL ends it.
    script = ("import os, signal, sys, time; r = int(os.environ['HOLMES_PROCESS_ID'])\n"
              "if r == 0: signal.signal(signal.SIGTERM, signal.SIG_IGN); open(os.environ['READY'], 'w').close(); "
              "time.sleep(300)\n"
              + _exit_once_rank_0_is_ready(4))
    r = run_module("holmes_jax.launch", "-n", "2", "--grace", "1", "--env", f"READY={tmp_path / 'ready'}", "--",
                   sys.executable, "-c", script, timeout=60)
    assert r.returncode == 4


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGTERM)])
def test_ctrl_c_or_sigterm_ends_all_processes_with_one_line(signals):
    # Both together: the second signal's handler raised while the first was handled, a traceback
    # and status 1.
    script = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--", sys.executable, "-c", script],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)) as p:
        pids = [int(p.stdout.readline().split()[-1]) for _ in range(2)]
        for sig in signals:
            p.send_signal(sig)
        _, err = p.communicate(timeout=30)
    # two signals at once arrive in either order; the one handled first names the stop
    assert p.returncode in [128 + sig for sig in signals], err
    first = signal.Signals(p.returncode - 128)
    ours = [line for line in err.splitlines() if not line.startswith("[rank ")]
    assert ours == [f"launch: {first.name} passed on to all; SIGKILL after 30 s"], err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


CTRL_C_IN_A_FORK_HOOK = """
import os, signal
from holmes_jax import cli, launch
sent = []
def ctrl_c_once():
    if not sent:
        sent.append(True)
        signal.raise_signal(signal.SIGINT)
os.register_at_fork(after_in_parent=ctrl_c_once)  # where logging's lock release runs too
cli.run(launch.main, ["-n", "2", "--grace", "1", "--", "sleep", "20"])
"""


def test_a_ctrl_c_that_lands_in_a_fork_hook_still_stops_the_job():
    # Popen runs Python's fork hooks (logging's) for the preexec_fn; a Ctrl-C handled in one raised
    # an exception that Python only printed as ignored: the job ran to its end with status 0.
    r = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_FORK_HOOK], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 128 + signal.SIGINT, r.stderr
    assert r.stderr.splitlines() == ["launch: SIGINT passed on to all; SIGKILL after 1 s"], r.stderr


def test_a_hangup_under_nohup_leaves_the_job_running():
    # nohup ignores SIGHUP; the children inherit that, so passing one on would only wait out the
    # grace period and SIGKILL them
    script = "import os, time; print(os.getpid(), flush=True); time.sleep(3)"
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--grace", "1", "--", sys.executable, "-c", script],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))) as p:
        [p.stdout.readline() for _ in range(2)]
        p.send_signal(signal.SIGHUP)
        assert p.wait(timeout=30) == 0


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


def _assert_ends_soon(pid: int, what: str) -> None:
    """`pid` is gone within 10 s of the launcher's end (a killed orphan is reaped by init, not us);
    killed here if not, so no test leaves it running."""
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert _gone(pid), f"{what} outlived the launcher"
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_what_a_wrapper_script_started_gets_the_grace_period_and_then_sigkill(tmp_path):
    # Each rank is a shell that runs python as its child (as a wrapper script does). Rank 1 fails;
    # rank 0's shell dies of the SIGTERM at once, its python ignores it: SIGKILL must still reach it.
    ready = tmp_path / "ready"
    script = ("import os, signal, sys, time; r = os.environ['HOLMES_PROCESS_ID']; ready = os.environ['READY']\n"
              "if r == '1':\n"
              "    for _ in range(600):\n"
              "        if os.path.exists(ready): sys.exit(3)\n"
              "        time.sleep(0.1)\n"
              "    sys.exit(9)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); open(ready, 'w').close()\n"
              "time.sleep(300)")
    t = time.monotonic()
    r = run_module("holmes_jax.launch", "-n", "2", "--grace", "1", "--env", f"READY={ready}", "--",
                   "sh", "-c", '"$0" -c "$1"; exit $?', sys.executable, script, timeout=120)
    assert r.returncode == 3, r.stderr
    _assert_ends_soon(int(r.stdout.split("] ")[1]), "rank 0's python")
    assert time.monotonic() - t < 60


def test_a_process_that_left_its_group_is_stopped_too():
    # A rank starts a helper in a session of its own (setsid, a daemon) and fails: a signal to the
    # rank's process group misses the helper, which ran on after the launcher.
    script = ("import subprocess, sys\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True,\n"
              "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              "print(p.pid, flush=True); sys.exit(3)")
    r = run_module("holmes_jax.launch", "-n", "1", "--grace", "1", "--", sys.executable, "-c", script, timeout=60)
    _assert_ends_soon(int(r.stdout.split("] ")[1]), "the helper")
    assert r.returncode == 3, r.stderr


def test_output_read_no_further_neither_hangs_nor_fails():
    # `launch ... | head -1`: the processes' output must still be drained (a full pipe would block
    # them for ever) and the job's status kept.
    script = "for i in range(100000): print('line', i, 'x' * 100)"
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--", sys.executable, "-c", script],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)) as p:
        assert p.stdout.readline().startswith("[rank ")
        p.stdout.close()
        assert p.wait(timeout=60) == 0
        assert "Traceback" not in p.stderr.read()


@pytest.mark.parametrize("how", ["a full disk", "a latin-1 output"])
def test_output_that_cannot_be_written_does_not_stop_the_ranks_output_being_read(how, tmp_path):
    # A failed write (under cli.run an OutputFailed, not an OSError) or a character the output's
    # encoding lacks ended the thread reading the rank's pipe: the rank blocked on it for ever.
    script = (r"import sys; sys.stdout.buffer.write(b'bad \xff \xe2\x82\xac\n'); sys.stdout.flush(); "
              "[print('line', i, 'x' * 100) for i in range(20000)]")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if how == "a latin-1 output":
        env["PYTHONIOENCODING"] = "latin-1"
    target = "/dev/full" if how == "a full disk" else tmp_path / "out"
    with open(target, "w") as out:
        r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", "-n", "1", "--", sys.executable, "-c", script],
                           stdout=out, stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    if how == "a latin-1 output":
        lines = (tmp_path / "out").read_text(encoding="latin-1").splitlines()
        assert lines[0] == r"[rank 0] bad \ufffd \u20ac" and len(lines) == 20001


def test_a_stop_signal_reaches_each_rank_once():
    # The rank's group got it, then the rank again as a process carrying the launch's mark: a
    # script's Ctrl-C handler (saving something) was cut short by the second one.
    script = ("import signal, time\ngot = []\ndef saving(signum, frame):\n    got.append(signum)\n"
              "    time.sleep(0.5)\nsignal.signal(signal.SIGINT, saving)\nprint('ready', flush=True)\n"
              "while not got: time.sleep(0.01)\ntime.sleep(1)\nprint('signals', len(got), flush=True)")
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "1", "--", sys.executable, "-c", script],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)) as p:
        assert p.stdout.readline() == "[rank 0] ready\n"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert out == "[rank 0] signals 1\n" and p.returncode == 128 + signal.SIGINT, err


def test_a_rank_that_ended_keeps_its_pid_until_the_job_is_over(tmp_path):
    # Reaped at once, its pid (which names its process group) could go to another process, whose
    # group the stop's signals then reached.
    go = tmp_path / "go"
    script = ("import os, sys, time\nif os.environ['HOLMES_PROCESS_ID'] == '1':\n    print(os.getpid(), flush=True)\n"
              "    sys.exit(0)\nfor _ in range(300):\n    if os.path.exists(os.environ['GO']): break\n"
              "    time.sleep(0.1)")
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--env", f"GO={go}", "--", sys.executable, "-c",
             script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)) as p:
        pid = int(p.stdout.readline().split()[-1])
        time.sleep(0.5)
        state, parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        assert (state, int(parent)) == ("Z", p.pid)  # ended, not reaped: the pid is still the rank's
        go.touch()
        assert p.wait(timeout=30) == 0
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[3] != str(p.pid)


SUBREAPER = """
import ctypes, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to us, as to a container's PID 1
from holmes_jax import cli, launch
cli.run(launch.main, sys.argv[1:])
"""


def test_a_launcher_that_orphans_come_to_stops_without_waiting_out_the_grace_period():
    # A wrapper script's python, ended by the SIGTERM with its shell, became our zombie: counted as
    # running, the stop waited the grace period out twice (60 s by default).
    script = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-c", SUBREAPER, "-n", "1", "--grace", "20", "--", "sh", "-c", '"$0" -c "$1"; exit $?',
             sys.executable, script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as p:
        p.stdout.readline()
        t = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert time.monotonic() - t < 15


def test_a_holmes_jax_process_under_a_wrapper_script_ends_with_a_killed_launcher():
    # The kernel's parent-death signal reached the launcher's child, the shell; its python, which
    # the launcher's stop would have reached through the group, trained on as an orphan.
    script = ("import os, time; from holmes_jax import distributed; distributed.initialize(); "
              "print(os.getpid(), flush=True); time.sleep(300)")
    with killed_on_exit(subprocess.Popen(
            [sys.executable, "-m", "holmes_jax.launch", "-n", "1", "--", "sh", "-c", '"$0" -c "$1"; exit $?',
             sys.executable, script], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)) as p:
        pid = int(p.stdout.readline().split()[-1])
        p.kill()
        p.wait(timeout=30)
    _assert_ends_soon(pid, "the wrapper's python")


def test_of_ranks_found_failed_at_once_one_killed_by_a_signal_is_blamed():
    assert launch.first_failure([1, -9, None]) == (1, -9)  # rank 0's error is likely what the kill caused
    assert launch.first_failure([None, 3, 1]) == (1, 3)
    assert launch.first_failure([0, None]) is None


def test_more_processes_than_the_hosts_limits_take_is_said_of_n():
    import resource
    r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", "-n", "40", "--", "true"], capture_output=True,
                       text=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48)))
    assert r.returncode == 2 and r.stderr.startswith("error: -n 40: cannot start process "), r.stderr
    assert "Too many open files" in r.stderr


def test_timeout_stops_everything(capsys):
    t = time.monotonic()
    assert launch.launch([sys.executable, "-c", "import time; time.sleep(300)"], 2, timeout_s=1, grace_s=1) == launch.TIMED_OUT
    assert time.monotonic() - t < 30
    assert "still running after 1 s" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "true"], "no command to run"),
    (["-n", "0", "--", "true"], "-n = 0"),
    (["-n", "two", "--", "true"], "invalid int value"),
    (["--", "true"], "-n"),
    (["-n", "2", "--nic-classes", "infiniband", "--", "true"], "one per process"),
    (["-n", "2", "--nic-classes", "infiniband,myrinet", "--", "true"], "'myrinet'"),
    (["-n", "2", "--nic-classes", "", "--", "true"], "one per process"),  # an empty $VAR: was run without classes
    (["-n", "1", "--nic-classes", "", "--", "true"], "--nic-classes: '' is not allowed"),
    (["-n", "2", "--env", "NOEQUALS", "--", "true"], "KEY=VALUE"),
    (["-n", "2", "--port", "70000", "--", "true"], "--port"),
    (["-n", "2", "--grace", "-1", "--", "true"], "--grace = -1"),  # would SIGKILL at once
    (["-n", "2", "--grace", "nan", "--", "true"], "--grace = nan"),
    (["-n", "2", "--timeout", "0", "--", "true"], "--timeout = 0"),
    (["-n", "2", "--timeout", "nan", "--", "true"], "--timeout = nan"),  # would never fire
    (["-n", "2", "--env", "HOLMES_NUM_PROCESSES=4", "--", "true"], "--env HOLMES_NUM_PROCESSES"),  # 2 would wait for 4
    (["-n", "2", "--env", "HOLMES_LAUNCH_ID=x", "--", "true"], "--env HOLMES_LAUNCH_ID"),
    (["-n", "2", "--bogus", "--", "true"], "--bogus"),
    (["-n", "2", "--"], "no command to run"),
    (["-n", "2", "--", "/nonexistent/program"], "cannot run '/nonexistent/program'"),
])
def test_bad_arguments_exit_2_with_one_error_line(args, message):
    r = run_module("holmes_jax.launch", *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr
