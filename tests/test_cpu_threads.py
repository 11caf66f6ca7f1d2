"""The thread count follows the cores other processes leave free (tokenmill/worker/cpu_threads.py)."""
import itertools
import os
import subprocess
import sys
import time

import pytest
import torch

from tokenmill.worker import cpu_threads
from tokenmill.worker.cpu_threads import ThreadSizer, threads_for


def test_threads_for_takes_a_thread_per_busy_core_with_hysteresis(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert threads_for(0.0, 4, reduced=False) == 4
    assert threads_for(0.7, 4, reduced=False) == 4  # under TAKE_AT: noise, not a core taken
    assert threads_for(0.8, 4, reduced=False) == 3
    assert threads_for(2.0, 4, reduced=False) == 2
    assert threads_for(0.6, 4, reduced=True) == 3  # given back only under GIVE_BACK_BELOW
    assert threads_for(0.4, 4, reduced=True) == 4
    assert threads_for(9.0, 4, reduced=False) == 1  # never below one thread
    assert threads_for(0.0, 2, reduced=False) == 2  # never above the configured count


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("TOKENMILL_ADAPTIVE_THREADS", "0")
    sizer = ThreadSizer()
    sizer.update()
    assert sizer.threads == sizer.max_threads == torch.get_num_threads()


@pytest.mark.skipif(not os.path.exists("/proc/stat") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores")
def test_a_spinning_neighbour_takes_a_thread(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "INTERVAL_S", 0.2)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        sizer = ThreadSizer()
        deadline = time.monotonic() + 10
        while sizer.threads == 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            sizer.update()
        assert sizer.threads == 1 and torch.get_num_threads() == 1
    finally:
        spinner.kill()
        spinner.wait()
        torch.set_num_threads(threads)


def test_next_engine_starts_from_the_users_count(monkeypatch):
    """A sizer that lowered the process's thread count does not cap the next engine in the same process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads, "INTERVAL_S", 0.0)
    busy = 10 * os.sysconf("SC_CLK_TCK")
    ticks = itertools.chain([(0, 0)], itertools.repeat((busy, 0)))  # then the rest of the machine was busy
    monkeypatch.setattr(cpu_threads, "_cpu_ticks", lambda: next(ticks))
    try:
        first = ThreadSizer()
        time.sleep(0.01)
        first.update()
        assert first.threads == 1 and torch.get_num_threads() == 1
        second = ThreadSizer()
        assert second.max_threads == 2 and torch.get_num_threads() == 2
        torch.set_num_threads(1)  # but a count the user set themselves is theirs
        monkeypatch.setattr(cpu_threads, "_lowered", (3, 2))
        assert ThreadSizer().max_threads == 1
    finally:
        torch.set_num_threads(threads)
