"""The policy catalogue: every registered `Policy` by name, loading ``simdist.policies`` on first use."""

from __future__ import annotations

from simdist.gradpath.policy import _REGISTRY, Policy


def _load_catalogue() -> None:
    import simdist.policies  # noqa: F401 - importing registers every policy module


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; ``ValueError`` listing the valid names otherwise."""
    _load_catalogue()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    """Names of every registered policy, in registration order."""
    _load_catalogue()
    return list(_REGISTRY)
