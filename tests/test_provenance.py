"""A run records what made it (jaxascend.provenance): the versions are the running interpreter's,
the commit is the source tree's (None, never an error, where there is no checkout or no git), the
vector ISA is read from the CPU flags, the AdamW kernel is the extension's own choice, and a
resume names what changed since its checkpoint."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import flax
import jax
import jaxlib
import numpy
import optax
import pytest

from jaxascend import provenance
from jaxascend.native import extension
from jaxascend.provenance import RunStack, collect, cpu_of, source_tree, vector_isa

REPO = Path(__file__).resolve().parents[1]
HAS_GIT = shutil.which("git") is not None
ISA_ENV = "JAXASCEND_ADAM_ISA"

# /proc/cpuinfo flag lines of real machines (trimmed of flags no level reads, not of those it does)
ZEN2_AVX2 = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
             "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl pni pclmulqdq ssse3 fma cx16 "
             "sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm sse4a bmi1 avx2 smep "
             "bmi2 rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec clzero")
SKYLAKE_AVX512 = ("fpu vme de pse tsc msr pae mce cx8 apic sep sse sse2 ss ht syscall nx pdpe1gb rdtscp lm pni "
                  "pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand "
                  "hypervisor fsgsbase bmi1 hle avx2 smep bmi2 erms invpcid rtm mpx avx512f avx512dq rdseed adx "
                  "smap clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves")
SAPPHIRE_RAPIDS_AMX = ("fpu vme de pse tsc msr sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq "
                       "avx512ifma avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 "
                       "avx512_vnni avx512_bitalg avx512_vpopcntdq la57 serialize tsxldtrk amx_bf16 avx512_fp16 "
                       "amx_tile amx_int8")
ZEN4_BF16 = "sse sse2 sse4_1 sse4_2 avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
GRAVITON3 = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop "
             "sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm "
             "svebf16 i8mm bf16 dgh rng")


@pytest.mark.parametrize("flags, isa", [
    (ZEN2_AVX2, "avx2"), (SKYLAKE_AVX512, "avx512"), (SAPPHIRE_RAPIDS_AMX, "avx512_bf16+amx"),
    (ZEN4_BF16, "avx512_bf16"), (GRAVITON3, "sve"), ("fp asimd evtstrm aes", "neon"),
    ("fpu vme sse sse2", "sse2"), ("fpu vme de", None), ("", None)])
def test_the_vector_isa_is_the_best_level_the_flags_list(flags, isa):
    assert vector_isa(flags.split()) == isa


def test_the_cpu_model_and_flags_come_from_the_first_processor():
    x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B12  64-Core Processor\n"
           f"flags\t\t: {ZEN2_AVX2}\n\nprocessor\t: 1\nmodel name\t: something else\nflags\t\t: fpu\n")
    model, flags = cpu_of(x86)
    assert model == "AMD EPYC 7B12 64-Core Processor" and vector_isa(flags) == "avx2" and "fpu" in flags
    arm = f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {GRAVITON3}\nCPU implementer\t: 0x41\n"
    assert cpu_of(arm) == (None, frozenset(GRAVITON3.split()))
    assert cpu_of("") == (None, frozenset())


def test_collect_matches_the_running_interpreter():
    stack = collect()
    assert (stack.jax, stack.jaxlib, stack.flax, stack.optax, stack.numpy) == (
        jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__, numpy.__version__)
    assert stack.python == platform.python_version()
    assert stack.jaxascend == importlib.metadata.version("jaxascend")
    assert (stack.backend, stack.device_kind, stack.device_count) == (
        jax.default_backend(), jax.devices()[0].device_kind, jax.device_count())
    assert stack.cpu and stack.adamw_kernel == extension.adamw_default_isa()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model, flags = cpu_of(cpuinfo.read_text())
        assert stack.cpu_isa == vector_isa(flags) and (model is None or stack.cpu == model)
    record = stack.to_dict()
    assert json.loads(json.dumps(record)) == record and RunStack(**record) == stack
    assert stack.differences(record) == [] and stack.resume_note(record, 3) is None


@pytest.mark.skipif(not HAS_GIT or not (REPO / ".git").exists() or provenance.PACKAGE_DIR != REPO / "jaxascend",
                    reason="the package is not imported from a git checkout here")
def test_the_commit_is_the_checkouts_the_package_was_imported_from():
    commit, modified = source_tree()
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and isinstance(modified, bool)
    # HEAD may move on while the test runs (a commit in the same tree): the recorded one is behind it or it.
    assert subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO).returncode == 0


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not HAS_GIT, reason="git is not installed")
def test_a_checkout_gives_its_commit_and_whether_it_was_changed(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "pkg/__init__.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert source_tree(package) == (head, False)
    (package / "__init__.py").write_text("x = 2\n")
    assert source_tree(package) == (head, True)
    # A package folder the checkout does not track (an installed copy inside it) is not its code.
    stray = tmp_path / "venv" / "site" / "pkg"
    stray.mkdir(parents=True)
    (stray / "__init__.py").write_text("")
    assert source_tree(stray) == (None, None)


def test_no_checkout_no_git_or_a_hung_git_gives_none(tmp_path, monkeypatch):
    package = tmp_path / "plain" / "pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above tmp_path counts
    assert source_tree(package) == (None, None)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no git at all
    assert source_tree(package) == (None, None)
    fake = bin_dir / "git"
    fake.write_text("#!/bin/sh\nexec sleep 5\n")
    fake.chmod(0o755)
    monkeypatch.setattr(provenance, "GIT_TIMEOUT_S", 0.2)
    assert source_tree(package) == (None, None)
    fake.write_text("#!/bin/sh\necho 'fatal: detected dubious ownership' >&2\nexit 128\n")
    assert source_tree(package) == (None, None)


def _kernel_the_flags_allow(flags: frozenset) -> str:
    """optim_adam.cc's AdamIsaSupported / ResolveAdamIsa, from the CPU flags."""
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "f16c"} <= flags else "scalar"


def test_the_kernel_is_the_extensions_own_choice(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    chosen = extension.adamw_default_isa()
    assert provenance.adamw_kernel() == chosen and chosen in extension.adamw_supported_isas()
    if platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").is_file():
        assert chosen == _kernel_the_flags_allow(cpu_of(Path("/proc/cpuinfo").read_text())[1])
    for asked in extension.adamw_supported_isas():
        monkeypatch.setenv(ISA_ENV, asked)
        assert provenance.adamw_kernel() == asked == extension.adamw_default_isa()
        assert provenance.adamw_kernel("int8") == ("avx2" if asked == "avx512" else asked)
    monkeypatch.setenv(ISA_ENV, "sse9")  # refused by name at the first step; provenance does not fail first
    assert provenance.adamw_kernel() is None


def test_int8_state_has_no_avx512_variant_of_its_own():
    # adamw_kernel's int8 rule replicates RangeFor; a new AVX-512 int8 variant must change both.
    source = (REPO / "ffi" / "optim_adam.cc").read_text()
    rule = re.search(r"if \(state == AdamState::kInt8 && \(isa == AdamIsa::kAvx512 \|\| isa == AdamIsa::kAvx2\)\) "
                     r"\{\s*return (\w+)\(", source)
    assert rule and rule.group(1) == "Avx2Range"


STACK = RunStack(jaxascend="0.1.0", git_commit="1a2b3c4d" + "0" * 32, git_modified=True, python="3.11.7",
                 jax="0.10.2", jaxlib="0.10.2", flax="0.12.8", optax="0.2.8", numpy="2.4.6", cpu="AMD EPYC",
                 cpu_isa="avx2", adamw_kernel="avx2", backend="cpu", device_kind="cpu", device_count=1)


def test_one_line_says_the_source_the_libraries_the_cpu_and_the_devices():
    assert STACK.one_line() == ("jaxascend 0.1.0 (git 1a2b3c4, modified) · jax 0.10.2 · AMD EPYC, avx2, "
                                "adamw kernel avx2 · cpu x1")
    gpu = dataclasses.replace(STACK, git_commit=None, git_modified=None, jaxlib="0.10.1", backend="gpu",
                              device_kind="NVIDIA H200", device_count=8, cpu_isa=None)
    assert gpu.one_line() == ("jaxascend 0.1.0 · jax 0.10.2 (jaxlib 0.10.1) · AMD EPYC, vector ISA unknown, "
                              "adamw kernel avx2 · gpu NVIDIA H200 x8")


def test_differences_name_each_change_and_the_resume_note_sums_them():
    assert STACK.differences(STACK.to_dict()) == [] and STACK.resume_note(STACK.to_dict(), 7) is None
    recorded = {**STACK.to_dict(), "jax": "0.10.1", "cpu": "Intel Xeon Platinum 8481C", "cpu_isa": "avx512_bf16+amx",
                "adamw_kernel": "avx512", "git_commit": "9f8e7d6c" + "0" * 32, "git_modified": False,
                "device_count": 2}
    assert STACK.differences(recorded) == [
        "git 9f8e7d6 -> 1a2b3c4", "source tree clean -> modified", "jax 0.10.1 -> 0.10.2",
        "CPU Intel Xeon Platinum 8481C -> AMD EPYC", "vector ISA avx512_bf16+amx -> avx2",
        "AdamW kernel avx512 -> avx2", "devices cpu x2 -> cpu x1"]
    assert STACK.resume_note({**STACK.to_dict(), "jax": "0.10.1", "backend": "gpu", "device_kind": "NVIDIA H200"},
                             7) == ("the software or machine changed since checkpoint step 7: jax 0.10.1 -> 0.10.2; "
                                    "devices gpu NVIDIA H200 x1 -> cpu x1; results may differ in the last bits")
    # An older record without some fields compares what it has; a commit then unknown is said so.
    assert STACK.differences({"numpy": "2.4.6", "git_commit": None}) == [
        "git none (not a git checkout) -> 1a2b3c4"]
    assert STACK.differences({}) == []


def test_importing_the_module_imports_neither_jax_nor_the_extension():
    code = ("import sys, jaxascend.provenance\n"
            "print(sorted(m for m in ('jax', 'jaxascend._native', 'flax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
