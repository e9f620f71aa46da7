"""Building and caching the C kernels with the machine's compiler, and every way that fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.kernels.cpu import build
from pdserve.kernels.cpu.build import CpuKernelsUnavailable, load_library

SOURCE = "int pdserve_answer(void) { return 42; }\n"


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    load_library.cache_clear()
    path = tmp_path / "answer.c"
    path.write_text(SOURCE)
    yield path
    load_library.cache_clear()


def test_compiles_once_then_loads_the_cached_build(source):
    assert load_library(source).pdserve_answer() == 42
    (built,) = build.cache_dir().glob("answer-*.so")
    first = built.stat()
    load_library.cache_clear()
    assert load_library(source).pdserve_answer() == 42
    assert built.stat().st_ino == first.st_ino and built.stat().st_mtime_ns == first.st_mtime_ns
    assert [p.name for p in build.cache_dir().iterdir()] == [built.name], "no temporary files are left"


def test_an_edited_source_gets_its_own_build_which_replaces_the_old_one(source):
    load_library(source)
    (old,) = build.cache_dir().glob("answer-*.so")
    source.write_text(SOURCE.replace("42", "43"))
    load_library.cache_clear()
    assert load_library(source).pdserve_answer() == 43
    (new,) = build.cache_dir().glob("answer-*.so")
    assert new != old


def test_an_edited_header_beside_the_source_gets_its_own_build(source):
    header = source.parent / "answer.h"
    header.write_text("#define ANSWER 42\n")
    source.write_text('#include "answer.h"\nint pdserve_answer(void) { return ANSWER; }\n')
    assert load_library(source).pdserve_answer() == 42
    header.write_text("#define ANSWER 44\n")
    load_library.cache_clear()
    assert load_library(source).pdserve_answer() == 44


def test_no_compiler_says_what_to_install(source, monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CpuKernelsUnavailable, match="no C compiler found.*install gcc"):
        load_library(source)


def test_a_failing_compile_shows_the_compiler_output_and_leaves_nothing(source, monkeypatch, tmp_path):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'answer.c:1: boom' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(CpuKernelsUnavailable, match=r"(?s)compiling answer.c failed.*boom"):
        load_library(source)
    assert list(build.cache_dir().iterdir()) == []


def test_an_unwritable_cache_names_the_directory_and_the_setting(source, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocker))
    with pytest.raises(CpuKernelsUnavailable, match=f"cannot write the kernel cache {blocker}.*PDSERVE_CACHE_DIR"):
        load_library(source)


def test_cache_dir_follows_xdg_when_pdserve_cache_dir_is_unset(monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "pdserve" / "cpu_kernels"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", os.fspath(tmp_path / "x"))
    assert build.cache_dir() == tmp_path / "x" / "cpu_kernels"


def test_a_prebuilt_kernel_is_loaded_without_compiling_or_writing_the_cache(source, monkeypatch, tmp_path):
    (library,) = build.prebuild(tmp_path / "prebuilt", [source])
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(tmp_path / "prebuilt"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocker))  # a compile would fail: the cache is unwritable
    assert load_library(source).pdserve_answer() == 42
    assert library.is_file()


def test_a_prebuilt_directory_without_this_build_falls_back_to_the_cache(source, monkeypatch, tmp_path):
    build.prebuild(tmp_path / "prebuilt", [source])
    monkeypatch.setenv("PDSERVE_KERNEL_DIR", str(tmp_path / "prebuilt"))
    source.write_text(SOURCE.replace("42", "45"))  # another source: another name
    assert load_library(source).pdserve_answer() == 45
    assert len(list(build.cache_dir().glob("answer-*.so"))) == 1
