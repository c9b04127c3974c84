"""`simdist.extras`: whether an optional framework is importable, without an exception for a missing parent."""

from __future__ import annotations

import importlib.util

import pytest

from simdist.cases import case_names, get_case, run_case
from simdist.extras import EXTRAS, importable, install_hint, installed, missing_extras, not_installed_reason


def test_a_missing_parent_package_is_not_importable():
    """``find_spec("megatron.core")`` raises when ``megatron`` is absent; `importable` answers False."""
    with pytest.raises(ModuleNotFoundError):
        importlib.util.find_spec("simdist_absent_parent.core")
    assert importable("simdist_absent_parent.core") is False
    assert importable("os.path.not_a_submodule") is False  # the parent is a module, not a package
    assert importable("simdist_absent_module") is False
    assert importable("json.decoder") is True


def test_installed_follows_the_module_of_each_extra(monkeypatch):
    assert set(EXTRAS) == {"deepspeed", "megatron"}
    monkeypatch.setitem(EXTRAS, "megatron", "simdist_absent_parent.core")
    assert installed("megatron") is False
    assert missing_extras(["megatron"]) == ["megatron"]
    monkeypatch.setitem(EXTRAS, "megatron", "json.decoder")
    assert installed("megatron") is True and missing_extras(("megatron",)) == []


def test_unknown_extra_is_refused_listing_the_valid_ones():
    with pytest.raises(ValueError, match="valid: deepspeed, megatron"):
        installed("fairscale")


def test_hints_name_the_extra_and_how_to_install_it():
    assert install_hint("deepspeed").startswith("DS_BUILD_OPS=0 pip install 'simdist-lab[deepspeed]'")
    assert "pip install -e '.[megatron]'" in install_hint("megatron")
    assert not_installed_reason("megatron").startswith("the megatron extra is not installed: pip install")


def test_a_case_refuses_threads_before_asking_for_its_framework(monkeypatch):
    """Whether a case runs on threads is the case's own property: it is refused the same way with or without
    its framework installed (with the framework hidden here, the refusal still names threads)."""
    monkeypatch.setitem(EXTRAS, "deepspeed", "simdist_absent_parent.core")
    monkeypatch.setitem(EXTRAS, "megatron", "simdist_absent_parent.core")
    for name in case_names():
        case = get_case(name)
        if case.processes_because is None:
            continue
        with pytest.raises(ValueError, match="runs in processes only"):
            run_case(name, where="threads")
        if case.requires:  # and with a world it could run in, the missing extra is named with its command
            with pytest.raises(ValueError, match=f"needs the {case.requires[0]} extra: .*pip install"):
                run_case(name, where="gloo")
