"""Benchmark of the fused host AdamW kernel against jitted jnp/optax AdamW, a numpy AdamW and
the memory-bandwidth limit, on the same flat buffers. Prints JSON; rates are parameters/second.

    python scripts/bench_adam.py                       # 64M and 256M parameters
    python scripts/bench_adam.py --sizes 4M --reps 3   # smoke run
    python scripts/bench_adam.py --plot bench_adam.png

The bandwidth limit is ``jaxascend._native.adamw_bandwidth_probe``: a native pass over the
same buffers with the same threads and the same 28 bytes per parameter as the kernel with
16-bit gradients and params (fp32 master, m, v read and written in place; a 2-byte gradient
read and a 2-byte param written), doing no Adam arithmetic. It is compiled for AVX-512/AVX2
where the CPU has them, so its rate is what the memory system allows that access pattern.

Every method does one full AdamW step per timed call: the fused kernel on numpy arrays
(1 and 2 threads; fp16, bf16 and fp32 gradients); ``adamw_reference`` and ``optax.adamw``
jitted with donated state (XLA's own threads, all cores); and numpy with preallocated
scratch (one thread). Baselines use fp16 gradients. The compute params are fp16 for fp16
gradients and bf16 otherwise. A rate is n / median seconds over --reps calls after a warm-up.
The probe and the kernel variants take turns within each repetition on the same buffers, so
the ratio kernel/limit holds up on a machine shared with other work; absolute rates do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import psutil

from jaxascend.native import extension as _native
from jaxascend.optim import AdamHyperParams, adamw_reference, default_isa, fused_adamw_update_numpy

HPARAMS = AdamHyperParams(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01,
                          grad_scale=0.5, count=10)
NP_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
             "float32": np.dtype(np.float32)}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def param_dtype_for(grad_dtype: str) -> str:
    return grad_dtype if grad_dtype != "float32" else "bfloat16"


def time_interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per call of each function, after one warm-up call each. The functions
    take turns within every repetition, so load from other processes on a shared machine
    hits all of them alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class Buffers:
    """One size's flat buffers, shared by every method: fp32 master/m/v, and a gradient and a
    compute-params buffer per gradient dtype."""

    def __init__(self, n: int, grad_dtypes: list[str], seed: int = 0):
        rng = np.random.default_rng(seed)
        self.n = n
        self.master = rng.standard_normal(n, dtype=np.float32)
        self.m = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
        self.v = np.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-6)
        grad32 = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        self.grads = {d: grad32.astype(NP_DTYPES[d]) for d in grad_dtypes}
        # fill() touches every page now, so no timed call pays for first-touch faults.
        self.params = {}
        for d in grad_dtypes:
            self.params[d] = np.empty(n, NP_DTYPES[param_dtype_for(d)])
            self.params[d].fill(0)

    def fused(self, grad_dtype: str, threads: int):
        scalars = np.asarray(HPARAMS.scalars())
        grad, params = self.grads[grad_dtype], self.params[grad_dtype]
        return lambda: fused_adamw_update_numpy(self.master, self.m, self.v, grad, params,
                                                scalars, threads=threads)

    def probe(self, threads: int):
        grad16 = self.grads["float16"].view(np.uint16)
        params16 = self.params["float16"].view(np.uint16)
        return lambda: _native.adamw_bandwidth_probe(self.master, self.m, self.v, grad16,
                                                     params16, 1.0, threads)


def bench_kernel_and_limit(bufs: Buffers, grad_dtypes: list[str], threads: list[int],
                           reps: int) -> tuple[dict, dict]:
    """Rates of the bandwidth probe and the fused kernel, timed in turns on the same buffers."""
    limit, fused = {}, {d: {} for d in grad_dtypes}
    for t in threads:
        fns = {"limit": bufs.probe(t)} if "float16" in grad_dtypes else {}
        fns.update({d: bufs.fused(d, t) for d in grad_dtypes})
        for name, seconds in time_interleaved(fns, reps).items():
            (limit if name == "limit" else fused[name])[f"{t}_threads"] = bufs.n / seconds
    return limit, fused


def bench_numpy(bufs: Buffers, reps: int) -> float:
    master, m, v = bufs.master, bufs.m, bufs.v
    grad, params = bufs.grads["float16"], bufs.params["float16"]
    lr, b1, b2, eps, wd, gs, bc1, bc2, omb1, omb2 = (np.float32(x) for x in
                                                      np.asarray(HPARAMS.scalars()))
    inv_bc1, inv_bc2 = np.float32(1) / bc1, np.float32(1) / bc2
    g, tmp = np.empty(bufs.n, np.float32), np.empty(bufs.n, np.float32)

    def step():
        nonlocal master, m, v, g, tmp  # the in-place operators below rebind these names
        np.multiply(grad, gs, out=g, dtype=np.float32)
        m *= b1
        np.multiply(g, omb1, out=tmp)
        m += tmp
        v *= b2
        np.multiply(g, g, out=tmp)
        tmp *= omb2
        v += tmp
        np.multiply(v, inv_bc2, out=tmp)
        np.sqrt(tmp, out=tmp)
        tmp += eps
        np.multiply(m, inv_bc1, out=g)
        g /= tmp
        np.multiply(master, wd, out=tmp)
        g += tmp
        g *= lr
        master -= g
        params[...] = master  # rounds to the param dtype

    return bufs.n / time_interleaved({"numpy": step}, reps)["numpy"]


def bench_jnp(bufs: Buffers, reps: int) -> float:
    """adamw_reference jitted with donated state (copies of the buffers in XLA's memory)."""
    state = [jnp.asarray(bufs.master), jnp.asarray(bufs.m), jnp.asarray(bufs.v)]
    grad = jnp.asarray(bufs.grads["float16"])
    scalars = HPARAMS.scalars()
    step = jax.jit(lambda *a: adamw_reference(*a, param_dtype=jnp.float16),
                   donate_argnums=(0, 1, 2))

    def call():
        out = step(*state, grad, scalars)
        jax.block_until_ready(out)
        state[:] = out[:3]

    return bufs.n / time_interleaved({"jnp": call}, reps)["jnp"]


def bench_optax(bufs: Buffers, reps: int) -> float:
    """optax.adamw update + apply_updates + cast to fp16, jitted with donated state."""
    tx = optax.adamw(HPARAMS.lr, b1=HPARAMS.b1, b2=HPARAMS.b2, eps=HPARAMS.eps,
                     weight_decay=HPARAMS.weight_decay)
    params = jnp.asarray(bufs.master)
    carry = [params, tx.init(params)]
    grad = jnp.asarray(bufs.grads["float16"])

    def step(params, opt_state, grad):
        updates, opt_state = tx.update(grad.astype(jnp.float32) * HPARAMS.grad_scale, opt_state,
                                       params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, params.astype(jnp.float16)

    step = jax.jit(step, donate_argnums=(0, 1))

    def call():
        params, opt_state, compute = step(*carry, grad)
        jax.block_until_ready(compute)
        carry[:] = [params, opt_state]

    return bufs.n / time_interleaved({"optax": call}, reps)["optax"]


def busy_processes() -> list[str]:
    """Other processes using more than 20% of a core over half a second."""
    procs = list(psutil.process_iter(["pid", "name"]))
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(0.5)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if p.pid != os.getpid() and pct > 20:
            busy.append(f"{p.info['name']}({p.pid}) {pct:.0f}%")
    return busy


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels, values = [], []
        for key, rate in r["bandwidth_limit"].items():
            labels.append(f"limit {key}")
            values.append(rate)
        for dtype, rates in r["fused"].items():
            for key, rate in rates.items():
                labels.append(f"fused {dtype} {key}")
                values.append(rate)
        for key in ("jnp_adamw_jit", "optax_adamw_jit", "numpy_adamw"):
            labels.append(key)
            values.append(r[key])
        ax.barh(labels, [x / 1e9 for x in values])
        ax.set_xlabel("Gparams/s")
        ax.set_title(f"{r['params'] / 2**20:.0f}M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64M,256M", help="comma list, e.g. 64M,256M or 1000000")
    parser.add_argument("--threads", default="1,2", help="kernel thread counts")
    parser.add_argument("--grad-dtypes", default="float16,bfloat16,float32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    grad_dtypes = args.grad_dtypes.split(",")

    report = {
        "machine": {"cpu": platform.processor() or platform.machine(),
                    "logical_cpus": os.cpu_count(), "kernel_isa": default_isa(),
                    "loadavg_before": os.getloadavg(), "busy_before": busy_processes()},
        "units": "parameters per second (median over reps)",
        "hparams": HPARAMS._asdict(),
        "results": [],
    }
    for n in (parse_size(s) for s in args.sizes.split(",")):
        bufs = Buffers(n, sorted(set(grad_dtypes) | {"float16"}))
        r = {"params": n, "bytes_per_param_fp16": 28}
        r["bandwidth_limit"], r["fused"] = bench_kernel_and_limit(bufs, grad_dtypes, threads,
                                                                  args.reps)
        r["jnp_adamw_jit"] = bench_jnp(bufs, args.reps)
        r["optax_adamw_jit"] = bench_optax(bufs, args.reps)
        r["numpy_adamw"] = bench_numpy(bufs, args.reps)
        del bufs
        if "float16" in r["fused"]:
            fused = r["fused"]["float16"]
            r["ratios_fp16"] = {
                **{f"fused_vs_limit_{k}": fused[k] / r["bandwidth_limit"][k] for k in fused},
                "best_fused_vs_best_jit": max(fused.values()) / max(r["jnp_adamw_jit"],
                                                                    r["optax_adamw_jit"]),
                "best_fused_vs_jnp_jit": max(fused.values()) / r["jnp_adamw_jit"],
                "best_fused_vs_optax_jit": max(fused.values()) / r["optax_adamw_jit"],
                "best_fused_vs_numpy": max(fused.values()) / r["numpy_adamw"],
            }
        report["results"].append(r)
    report["machine"]["loadavg_after"] = os.getloadavg()
    report["machine"]["busy_after"] = busy_processes()
    if args.plot:
        plot(report["results"], args.plot)
        report["plot"] = args.plot
    print(json.dumps(report, indent=2, default=float))


if __name__ == "__main__":
    main()
