"""``--policies`` and ``--policy-module``: the policies a command runs, after the user's own are registered."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from simdist.errors import UsageError

if TYPE_CHECKING:
    from simdist.cli.configs import PoliciesCommand


def load_policy_modules(sources: Iterable[str]) -> None:
    """Register the policies of each ``--policy-module`` (a ``.py`` file or a dotted module name)."""
    from simdist.policies.catalogue import load_policy_module

    for source in sources:
        load_policy_module(source)


def policy_list(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` checked: at least one, none twice, each registered (a `UsageError` names the valid ones)."""
    from simdist.policies.catalogue import get_policy

    if not names:
        raise UsageError("--policies needs at least one policy name")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(
            f"--policies {','.join(names)}: {', '.join(map(repr, twice))} listed more than once (each runs once)"
        )
    for name in names:
        get_policy(name)
    return names


def print_policies() -> int:
    """``simdist policies``: every registered policy with its summary, origin and two example chains."""
    from simdist.gradpath.families import Family
    from simdist.policies.catalogue import get_policy, policy_names, policy_origin

    for name in policy_names():
        policy = get_policy(name)
        print(f"{name}: {policy.summary}")
        print(f"    from: {policy_origin(name)}")
        print(f"    router (AVERAGE, tp=2): {policy.chain(Family.ROUTER_GATE_REPLICATED, 2)}")
        print(f"    expert (/tp, tp=2):     {policy.chain(Family.EXPERT, 2)}")
    return 0


def run_policies(command: PoliciesCommand) -> int:
    """``simdist policies``: the ``--policy-module`` policies registered, then every policy printed."""
    load_policy_modules(command.policy_module)
    return print_policies()
