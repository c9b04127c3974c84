"""``import simdist``, the pytest plugin and ``simdist --help`` cost nothing; the backend still registers.

Each import check runs in a fresh interpreter and reads its ``sys.modules``: no torch, no ``torch.distributed``,
no ``simdist.reduce.native`` (nothing compiled). The registration checks import torch in that interpreter, in
both orders, and make a one-rank ``simdist`` group that reduces.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from simdist import cli


def _fresh(code: str, timeout: float = 240) -> str:
    """Run ``code`` in a new interpreter; its stdout (fails the test with stderr when it fails)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


HEAVY = ("torch", "torch.distributed", "numpy", "simdist.world", "simdist.reduce.native")


@pytest.mark.parametrize(
    "statement",
    [
        "import simdist",
        "import simdist.pytest_plugin",
        "import simdist.cli",
        "from simdist.cli import main; assert main(['--help']) == 0",
        "from simdist.cli import main; assert main(['--version']) == 0",
        "from simdist.cli import main; assert main(['reprox']) == 2",
    ],
)
def test_light_entry_points_import_no_torch(statement):
    out = _fresh(f"import sys\n{statement}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    assert out.strip().splitlines()[-1] == "[]", out


def test_the_world_package_and_its_layout_import_no_torch():
    """``simdist.world`` registers nothing on import (`simdist._autoregister` is the one place), so its pure-Python
    layout module costs what it reads."""
    out = _fresh(
        "import sys\n"
        "from simdist.world.spec import ParallelSpec\n"
        "assert ParallelSpec(world_size=4, tp=2).world_size == 4\n"
        "print(sorted(m for m in ('torch', 'torch.distributed', 'simdist.world.backend') if m in sys.modules))\n"
    )
    assert out.strip().splitlines()[-1] == "[]", out


REGISTRATION = """
import sys
import torch.distributed as dist
assert "SIMDIST" in dist.Backend._plugins
assert "simdist.world" not in sys.modules
store = dist.HashStore()
dist.init_process_group("simdist", store=store, rank=0, world_size=1)
t = torch.tensor([1.5, -2.0])
dist.all_reduce(t)
print(dist.get_backend(), t.tolist(), hasattr(dist.monitored_barrier, "simdist_original"))
dist.destroy_process_group()
"""


@pytest.mark.slow  # seconds of the default suite; CI runs it with the slow tests
def test_plugin_and_backend_load_on_first_use():
    """The plugin's object imports no torch until it runs something; after only ``import simdist`` (which the
    plugin's import is), ``init_process_group("simdist")`` works and registering imported nothing of the backend
    (``simdist.world``) until the group is made."""
    out = _fresh(
        """
import sys
import simdist.pytest_plugin as plugin
world = plugin.SimdistWorld()
assert "torch" not in sys.modules
import torch
"""
        + REGISTRATION
        + "print(world.run(lambda rank: rank * 2, 2))\n"
    )
    assert out.strip().splitlines() == ["simdist [1.5, -2.0] True", "[0, 2]"]


@pytest.mark.slow
def test_backend_registers_when_torch_came_first():
    out = _fresh("import torch\nimport simdist\n" + REGISTRATION)
    assert out.strip() == "simdist [1.5, -2.0] True"


def test_backend_name_is_the_backends():
    from simdist import _autoregister
    from simdist.world.backend.process_group import BACKEND_NAME

    assert _autoregister.BACKEND == BACKEND_NAME


def test_a_mistyped_command_is_one_line(capsys):
    assert cli.main(["reprox"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'reprox'" in err


@pytest.mark.parametrize("where", ["build_parser", "_dispatch"])
def test_ctrl_c_anywhere_is_one_line_and_130(monkeypatch, capsys, where):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, where, interrupted)
    assert cli.main(["policies"]) == 130
    assert capsys.readouterr().err == "simdist: interrupted\n"


def test_the_command_installs_the_exit_at_once_handler_and_a_library_call_does_not(monkeypatch):
    import signal

    from simdist.cli import interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main(["--version"]) == 0
        assert signal.getsignal(signal.SIGINT) is before  # a library call keeps Python's KeyboardInterrupt
        monkeypatch.setattr(sys, "argv", ["simdist", "--version"])
        assert cli.main() == 0
        assert signal.getsignal(signal.SIGINT) is interrupt._interrupted
    finally:
        signal.signal(signal.SIGINT, before)


REAL_RUN = """
import os, sys
from simdist.cli import interrupt, main

interrupt.exit_on_interrupt()  # what main() does first; installed before "ready", so the window is the test's
print("ready", flush=True)
sys.argv = ["simdist", "repro", "8913", "--steps", "200", "--no-progress"]
sys.exit(main())
"""


def _interrupt_after(delay_s: float, code: str) -> tuple[int, str, str]:
    """Run ``code``, wait for its "ready" line, then ``delay_s``, then SIGINT; (status, stdout, stderr)."""
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    first = child.stdout.readline()
    assert first == "ready\n", (first, child.stderr.read() if child.stderr else "")
    time.sleep(delay_s)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    return child.returncode, first + out, err


@pytest.mark.parametrize("delay_s", [0.0, 0.3, 1.0], ids=["at-once", "importing-torch", "later"])
def test_a_real_ctrl_c_is_one_line_and_130(delay_s):
    """SIGINT to a real ``simdist repro 8913`` at any point after the handler is installed (the first thing
    ``main()`` does): in the imports of torch and numpy, where a ``KeyboardInterrupt`` would leave a
    half-imported module or abort, or in the run. Python's own start-up and the import of ``simdist.cli``
    come before ``main()``; there Python's default applies (docs/reference/cli-overview.md says so)."""
    status, _, err = _interrupt_after(delay_s, REAL_RUN)
    assert (status, err) == (130, "simdist: interrupted\n")


@pytest.mark.slow
def test_a_real_ctrl_c_while_running_is_one_line_and_130():
    status, _, err = _interrupt_after(6.0, REAL_RUN)
    assert (status, err) == (130, "simdist: interrupted\n")


CHILDREN = """
import multiprocessing, time
from simdist.cli import interrupt

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    child.start()
    interrupt.exit_on_interrupt()
    print(child.pid)
    print("ready", flush=True)
    time.sleep(120)
"""


def test_ctrl_c_stops_the_child_processes_it_started(tmp_path):
    """Process-mode and gloo ranks are our children: the handler terminates them before it exits."""
    import time
    from pathlib import Path

    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    # the child's pid comes first, then "ready": read both before the signal
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    assert child.stdout.readline() == "ready\n"
    import signal

    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert (child.returncode, err) == (130, "simdist: interrupted\n")
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 30
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the child still runs"
