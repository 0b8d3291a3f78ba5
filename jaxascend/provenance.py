"""What made a run: the software (jaxascend's version and source commit, JAX, Flax, optax, NumPy,
Python) and the machine (the CPU, its vector instructions, the AdamW kernel variant they dispatch,
the devices), recorded with the run so that a figure can be traced back and a resume can say
what changed since its checkpoint.

    stack = collect(state_dtype=cfg.optimizer.state_dtype)   # after jax.distributed is up
    summary["stack"] = stack.to_dict()                        # JSON-ready; also checkpoint metadata
    print(stack.one_line())     # jaxascend 0.1.0 (git 1a2b3c4, modified) · jax 0.10.2 · AMD EPYC, ...
    note = stack.resume_note(recorded, step=7)                # None when nothing changed

Nothing here fails a run: a value that cannot be read (no git, not a checkout, a package not
installed) is None. The AdamW kernel is the native extension's own report of its choice
(``adamw_default_isa``), not a guess from the CPU flags. Importing this module imports neither
JAX nor the extension; :func:`collect` does.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

PACKAGE_DIR = Path(__file__).resolve().parent
GIT_TIMEOUT_S = 3.0  # each git call; a slow or hung git leaves the commit None
# The vector ISA levels, best first: (label, the /proc/cpuinfo flags that make it).
X86_LEVELS = (("avx512_bf16+amx", {"avx512_bf16", "amx_tile", "amx_bf16"}), ("avx512_bf16", {"avx512_bf16"}),
              ("avx512", {"avx512f"}), ("avx2", {"avx2"}), ("avx", {"avx"}), ("sse4_2", {"sse4_2"}),
              ("sse2", {"sse2"}))
ARM_LEVELS = (("sve2", {"sve2"}), ("sve", {"sve"}), ("neon", {"asimd"}))
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")  # module = distribution name, each a RunStack field
# (field, its label in differences()), in the order the differences are said
CHANGE_LABELS = (("jaxascend", "jaxascend"), ("git_commit", "git"), ("git_modified", "source tree"),
                 ("python", "Python"), *((name, name) for name in LIBRARIES), ("cpu", "CPU"),
                 ("cpu_isa", "vector ISA"), ("adamw_kernel", "AdamW kernel"))


@dataclass(frozen=True)
class RunStack:
    """The software and machine of one run (see the module doc); None: could not be read."""

    jaxascend: Optional[str]  # the package's version (importlib.metadata)
    git_commit: Optional[str]  # the full commit of the source tree the package was imported from
    git_modified: Optional[bool]  # that tree has uncommitted changes (git status --porcelain not empty)
    python: str  # "3.11.9"
    jax: Optional[str]
    jaxlib: Optional[str]
    flax: Optional[str]
    optax: Optional[str]
    numpy: Optional[str]
    cpu: str  # /proc/cpuinfo's model name, else platform.processor(), else the machine ("x86_64")
    cpu_isa: Optional[str]  # the best vector ISA of the CPU flags: "avx512_bf16+amx", "avx512", "avx2", "neon"
    adamw_kernel: Optional[str]  # the fused AdamW variant the extension dispatches: "avx512", "avx2", "scalar"
    backend: str  # jax.default_backend(): "cpu", "gpu", "tpu"
    device_kind: str  # jax.devices()[0].device_kind: "cpu", "NVIDIA H200"
    device_count: int  # jax.device_count(): every device of the job

    def to_dict(self) -> dict:
        """The fields as JSON values (strings, booleans, an int, None)."""
        return dataclasses.asdict(self)

    def one_line(self) -> str:
        """``jaxascend 0.1.0 (git 1a2b3c4, modified) · jax 0.10.2 · AMD EPYC, avx2, adamw kernel avx2 · cpu x1``."""
        source = ""
        if self.git_commit:
            source = f" (git {self.git_commit[:7]}{', modified' if self.git_modified else ''})"
        jax = f"jax {self.jax}" + (f" (jaxlib {self.jaxlib})" if self.jaxlib and self.jaxlib != self.jax else "")
        machine = ", ".join([self.cpu, self.cpu_isa or "vector ISA unknown", f"adamw kernel {self.adamw_kernel}"])
        return " · ".join([f"jaxascend {self.jaxascend}{source}", jax, machine, _devices_text(self.to_dict())])

    def differences(self, recorded: Mapping) -> list[str]:
        """What differs from ``recorded`` (an earlier :meth:`to_dict`, e.g. a checkpoint's), one
        ``"jax 0.10.1 -> 0.10.2"`` per field, the devices as one entry. A field ``recorded`` lacks
        (an older record) is not compared. Uncommitted changes then and now on the same commit
        cannot be told apart, and are not reported."""
        now = self.to_dict()
        out = [f"{label} {_value_text(name, recorded[name])} -> {_value_text(name, now[name])}"
               for name, label in CHANGE_LABELS if name in recorded and recorded[name] != now[name]]
        device_fields = ("backend", "device_kind", "device_count")
        if any(name in recorded and recorded[name] != now[name] for name in device_fields):
            out.append(f"devices {_devices_text({**now, **recorded})} -> {_devices_text(now)}")
        return out

    def resume_note(self, recorded: Mapping, step: int) -> Optional[str]:
        """One line for a resumed run when the software or machine changed since the checkpoint
        of ``step`` (None when nothing did)."""
        changes = self.differences(recorded)
        if not changes:
            return None
        return (f"the software or machine changed since checkpoint step {step}: {'; '.join(changes)}; "
                "results may differ in the last bits")


def _value_text(name: str, value) -> str:
    if value is None:
        return "unknown" if name != "git_commit" else "none (not a git checkout)"
    if name == "git_commit":
        return str(value)[:7]
    if name == "git_modified":
        return "modified" if value else "clean"
    return str(value)


def _devices_text(fields: Mapping) -> str:
    """``cpu x1``, ``gpu NVIDIA H200 x8``."""
    backend, kind = fields.get("backend"), fields.get("device_kind")
    name = backend if not kind or str(kind).lower() == str(backend).lower() else f"{backend} {kind}"
    return f"{name} x{fields.get('device_count')}"


def collect(state_dtype: str = "float32") -> RunStack:
    """This process's :class:`RunStack`. ``state_dtype``: the run's ``optimizer.state_dtype``
    (int8 moments have no AVX-512 variant, see :func:`adamw_kernel`). Imports JAX and lists its
    devices: in a ``jax.distributed`` job, call it after the runtime is initialised."""
    import jax

    commit, modified = source_tree(PACKAGE_DIR)
    model, flags = cpu_of(_read_cpuinfo())
    devices = jax.devices()
    return RunStack(
        jaxascend=_distribution_version("jaxascend"), git_commit=commit, git_modified=modified,
        python=platform.python_version(), jax=_library_version("jax"), jaxlib=_library_version("jaxlib"),
        flax=_library_version("flax"), optax=_library_version("optax"), numpy=_library_version("numpy"),
        cpu=model or platform.processor() or platform.machine() or "unknown", cpu_isa=vector_isa(flags),
        adamw_kernel=adamw_kernel(state_dtype), backend=jax.default_backend(), device_kind=devices[0].device_kind,
        device_count=jax.device_count())


def _distribution_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _library_version(name: str) -> Optional[str]:
    """The running module's ``__version__`` when it is imported (what runs, whatever the
    metadata says), else the installed distribution's."""
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None) if module is not None else None
    return str(version) if version is not None else _distribution_version(name)


def adamw_kernel(state_dtype: str = "float32") -> Optional[str]:
    """The variant of the fused AdamW kernel a run's optimizer steps dispatch, as the native
    extension resolves ``isa='auto'`` (``JAXASCEND_ADAM_ISA`` if set, else the best this CPU
    supports: ``avx512``, ``avx2``, ``scalar``); None when the extension cannot say (not built,
    or ``JAXASCEND_ADAM_ISA`` names no variant: the first step will refuse it by name).
    ``state_dtype`` int8: an avx512 dispatch runs the AVX2 code (optim_adam.cc, ``RangeFor``)."""
    try:
        from jaxascend.native import extension
        isa = str(extension.adamw_default_isa())
    except (ImportError, ValueError):
        return None
    return "avx2" if state_dtype == "int8" and isa == "avx512" else isa


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_of(cpuinfo: str) -> tuple[Optional[str], frozenset[str]]:
    """(model name, flags) of the first processor in a ``/proc/cpuinfo`` text: x86's ``model
    name`` and ``flags``, ARM's ``Features`` (its model is often absent: None)."""
    model, flags = None, frozenset()
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "model name" and model is None:
            model = " ".join(value.split()) or None
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def vector_isa(flags: Iterable[str]) -> Optional[str]:
    """The best vector instruction set among ``flags`` (``/proc/cpuinfo``'s): ``"avx512_bf16+amx"``,
    ``"avx512_bf16"``, ``"avx512"`` (avx512f), ``"avx2"``, ``"avx"``, ``"sse4_2"``, ``"sse2"``; on
    ARM ``"sve2"``, ``"sve"``, ``"neon"``; None when none is listed."""
    present = set(flags)
    for label, needed in X86_LEVELS + ARM_LEVELS:
        if needed <= present:
            return label
    return None


def source_tree(package_dir: Path = PACKAGE_DIR) -> tuple[Optional[str], Optional[bool]]:
    """(commit, uncommitted changes) of the git checkout ``package_dir`` was imported from:
    ``git rev-parse HEAD`` in its parent folder, when git tracks the package there (an installed
    copy in site-packages inside some other checkout is not that checkout's code). (None, None)
    when it is not a checkout, git is missing, slow or refuses; the changes None when ``git
    status`` could not say."""
    folder = Path(package_dir).resolve().parent
    head = _git(folder, "rev-parse", "HEAD")
    tracked = _git(folder, "ls-files", "--error-unmatch", "--", f"{Path(package_dir).name}/__init__.py")
    if head is None or tracked is None:
        return None, None
    status = _git(folder, "status", "--porcelain")
    return head.strip() or None, None if status is None else bool(status.strip())


def _git(folder: Path, *args: str) -> Optional[str]:
    """``git args`` run in ``folder``: its stdout, or None when git is missing, fails or hangs.
    The caller's GIT_DIR / GIT_WORK_TREE do not redirect it, and ``git status`` takes no lock
    (GIT_OPTIONAL_LOCKS=0: it must not collide with a commit in the same tree)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    env["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        done = subprocess.run(["git", *args], cwd=folder, env=env, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None
