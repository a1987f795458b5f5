"""runtime/blas.py: children run on the system OpenBLAS unless GRPO_FLEET_NO_OPENBLAS opts out."""

from __future__ import annotations

import pytest

from grpo_fleet.runtime import blas

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


SAPPHIRE_RAPIDS = frozenset("fpu sse3 avx avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_fp16".split())


def test_the_kernels_follow_the_cpus_own_flags():
    # This VM's Xeon, which Debian's OpenBLAS 0.3.21 does not know: it fell back to Prescott (SSE3) kernels.
    assert blas.openblas_coretype(SAPPHIRE_RAPIDS) == "SkylakeX"
    assert blas.openblas_coretype(frozenset({"sse3", "avx", "avx2", "fma"})) == "Haswell"
    assert blas.openblas_coretype(frozenset({"sse3", "avx512f", "avx2"})) is None, "no fma: leave it to OpenBLAS"
    assert blas.openblas_coretype(frozenset()) is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 fma\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert blas.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "fma"}
    assert blas.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_a_child_gets_the_kernels_unless_the_user_chose_them(linux_with_openblas, monkeypatch):
    monkeypatch.setattr(blas, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    assert blas.child_env({"PATH": "/bin"})[blas.CORETYPE_ENV] == "SkylakeX"
    assert blas.child_env({blas.CORETYPE_ENV: "Haswell"})[blas.CORETYPE_ENV] == "Haswell"
    assert blas.CORETYPE_ENV not in blas.child_env({blas.DISABLE_ENV: "1"})
