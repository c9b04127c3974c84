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
        + "print(world.spawn(lambda rank: rank * 2, 2))\n"
    )
    assert out.strip().splitlines() == ["simdist [1.5, -2.0] True", "[0, 2]"]


@pytest.mark.slow
def test_backend_registers_when_torch_came_first():
    out = _fresh("import torch\nimport simdist\n" + REGISTRATION)
    assert out.strip() == "simdist [1.5, -2.0] True"


def test_backend_name_is_the_backends():
    from simdist import _autoregister
    from simdist.world.backend import BACKEND_NAME

    assert _autoregister.BACKEND == BACKEND_NAME


def test_light_help_is_the_full_help(capsys):
    """``simdist --help`` (the light parser) prints what the full parser would: same commands, same help."""
    assert cli.main(["--help"]) == 0
    light = capsys.readouterr().out
    full = cli.build_parser().format_help()
    assert light == full
    assert [name for name, _ in cli.COMMANDS] == list(cli.build_parser()._subparsers._group_actions[0].choices)


def test_a_mistyped_command_is_one_line(capsys):
    assert cli.main(["reprox"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice: 'reprox'" in err


@pytest.mark.parametrize("where", ["_light_parser", "build_parser", "_dispatch"])
def test_ctrl_c_anywhere_is_one_line_and_130(monkeypatch, capsys, where):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, where, interrupted)
    assert cli.main(["policies"]) == 130
    assert capsys.readouterr().err == "simdist: interrupted\n"


@pytest.mark.nightly
@pytest.mark.parametrize("delay_s", [1.0, 4.0], ids=["while-importing", "while-running"])
def test_a_real_ctrl_c_is_one_line_and_130(delay_s):
    """SIGINT to a real ``simdist repro 8913`` (after Python's own start-up, whose interrupts are Python's): one
    line on stderr, exit 130, whether it lands in the imports or in the run.

    Nightly, not slow: on the loaded 2-core CI machine the same run gave -2 (killed by SIGINT after printing
    the line) and -6 (an abort when the signal landed inside torch's C++ import): the claim does not hold
    there yet. The monkeypatched interrupts above run in the default suite."""
    import signal
    import time

    child = subprocess.Popen(
        [sys.executable, "-m", "simdist.cli", "repro", "8913", "--steps", "40", "--no-progress"],  # runs past 4 s
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay_s)
    child.send_signal(signal.SIGINT)
    err = child.communicate(timeout=120)[1]
    assert (child.returncode, err) == (130, "simdist: interrupted\n")
