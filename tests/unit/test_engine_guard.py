"""``eagle3.server.backends.engine_guard``: engine processes die with their server, stale handover dirs go.

A stand-in server process marks itself (``mark_server``) and starts one ``spawn`` child (armed while
unpickling ``ServerIdentity``, as vLLM's engine core is) and one ``fork`` child (armed by the at-fork
hook), each of which would sleep for a minute; SIGKILL of the stand-in must take both with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from eagle3.server.backends import engine_guard
from tests.e2e.live_server import wait_gone

REPO_ROOT = Path(__file__).resolve().parents[2]

STAND_IN = """
import multiprocessing, sys, time
from eagle3.server.backends import engine_guard
from tests.e2e.live_server import wait_gone

def sleep_long(ident):
    time.sleep(60)

def fork_grandchild(ident):  # a spawned child (armed) that forks one of its own, as an engine core may
    grandchild = multiprocessing.get_context("fork").Process(target=sleep_long, args=(None,))
    grandchild.start()
    print(grandchild.pid, flush=True)
    time.sleep(60)

if __name__ == "__main__":
    ident = engine_guard.mark_server()
    spawned = multiprocessing.get_context("spawn").Process(target=sleep_long, args=(ident,))
    forked = multiprocessing.get_context("fork").Process(target=sleep_long, args=(None,))
    middle = multiprocessing.get_context("spawn").Process(target=fork_grandchild, args=(ident,))
    spawned.start(); forked.start(); middle.start()
    print(spawned.pid, forked.pid, middle.pid, flush=True)
    time.sleep(60)
"""


def test_spawned_and_forked_children_and_grandchildren_die_with_a_sigkilled_server(tmp_path: Path) -> None:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop(engine_guard.SERVER_ENV, None)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        pids.append(int(proc.stdout.readline()))  # the grandchild forked by an armed spawn child
        children = [(p, engine_guard.start_time(p)) for p in pids]
        time.sleep(1.0)  # the spawn child has unpickled its argument (armed) by now
        assert all(started is not None and engine_guard.start_time(p) == started for p, started in children)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        alive = wait_gone([(p, str(s)) for p, s in children], timeout_s=10 * engine_guard.POLL_S)
        assert not alive, f"orphaned: {alive}"
    finally:
        proc.kill()
        proc.wait()


def test_arm_is_a_no_op_in_the_server_itself() -> None:
    assert not engine_guard.arm(engine_guard.identity())


def test_alive_knows_dead_reused_and_live_processes() -> None:
    assert engine_guard.alive(engine_guard.identity())
    pid, _, started = engine_guard.identity().partition(":")
    assert not engine_guard.alive(f"{pid}:{int(started) + 1}")  # same pid, other start time: reused pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = engine_guard.identity(child.pid)
    child.wait()
    assert not engine_guard.alive(ident)


def test_remove_stale_dirs_removes_only_dirs_of_dead_servers(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = engine_guard.identity(child.pid).replace(":", "-")
    child.wait()
    mine = engine_guard.owner_tag()
    names = {
        "dead": f"{engine_guard.DIR_PREFIX}{dead}-abc",
        "live": f"{engine_guard.DIR_PREFIX}{mine}xyz",
        "legacy": f"{engine_guard.DIR_PREFIX}k2j3h4",  # no owner in the name: cannot tell, kept
        "other": "something-else",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "states.safetensors").write_bytes(b"x" * 10)
    removed = engine_guard.remove_stale_dirs(str(tmp_path))
    assert removed == [str(tmp_path / names["dead"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "dead")
