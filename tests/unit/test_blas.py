"""blas.py: children run on the system OpenBLAS unless GRPO_FLEET_NO_OPENBLAS opts out."""

from __future__ import annotations

import pytest

from grpo_fleet import blas

FAKE_OPENBLAS = "/usr/lib/test-linux-gnu/libopenblas.so.0"


@pytest.fixture
def linux_with_openblas(monkeypatch):
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "find_openblas", lambda: FAKE_OPENBLAS)


def test_a_child_is_preloaded_with_openblas(linux_with_openblas):
    env = blas.child_env({"PATH": "/bin", "LD_PRELOAD": "/lib/other.so"})
    assert env["LD_PRELOAD"] == f"{FAKE_OPENBLAS} /lib/other.so"
    assert env["PATH"] == "/bin"


def test_the_opt_out_reaches_the_children(linux_with_openblas):
    env = blas.child_env({"PATH": "/bin", blas.DISABLE_ENV: "1"})
    assert "LD_PRELOAD" not in env
    assert env == {"PATH": "/bin", blas.DISABLE_ENV: "1"}


def test_the_opt_out_is_read_from_this_process_by_default(linux_with_openblas, monkeypatch):
    monkeypatch.setenv(blas.DISABLE_ENV, "1")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in blas.child_env()
