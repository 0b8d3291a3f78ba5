"""Data-parallel instant offload across two real processes on 127.0.0.1 (jax.distributed, gloo):
each process's sink receives exactly its slice of the *summed* gradient, layer by layer, and the
statistics every process sees are the global ones."""

from __future__ import annotations

import json
import textwrap

import numpy as np

from tests._jobs import local_job

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxascend.distributed import initialize
    from jaxascend.offload import offload_on_backward
    from jaxascend.offload.grad_sink import GradientScatter, MemorySink, register_memory_sink

    group = initialize(None)
    L, D, ROWS = 3, 15, 4            # 225 elements per layer: an odd size, padded to 2 x 113
    mesh = Mesh(np.array(jax.devices()), ("data",))
    scatter = GradientScatter("data", group.count)
    n = scatter.slice_size(D * D)
    buf = np.zeros(L * n * 4, np.uint8)
    sink = MemorySink()
    sink.add_tensor(0, buf, n * 4)
    handle = register_memory_sink(sink)

    def net(w, x, hook):
        def body(h, xs):
            wl, i = xs
            return jnp.tanh(h @ hook(wl, i)), None
        h, _ = jax.lax.scan(body, x, (w, jnp.arange(L)))
        return jnp.sum(h ** 2)

    def local(probes, w, x):
        loss = lambda p: net(w, x, lambda wl, i: offload_on_backward(wl, p[i], sink=handle, tensor=0, layer=i,
                                                                      scatter=scatter))
        value, stats = jax.value_and_grad(loss)(probes)
        return jax.lax.psum(value, "data"), stats

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P()),
                                 check_vma=False))
    w = np.asarray(jax.random.normal(jax.random.key(0), (L, D, D), jnp.float32)) * 0.3
    x = np.asarray(jax.random.normal(jax.random.key(1), (ROWS, D), jnp.float32))
    rows = ROWS // group.count
    replicated = NamedSharding(mesh, P())
    loss, stats = step(jax.make_array_from_process_local_data(replicated, np.zeros((L, 2), np.float32)),
                       jax.make_array_from_process_local_data(replicated, w),
                       jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                                              x[group.index * rows:(group.index + 1) * rows]))
    stats = np.asarray(stats.addressable_shards[0].data)
    print(json.dumps({"index": group.index, "loss": float(np.asarray(loss.addressable_shards[0].data)),
                      "slices": buf.view(np.float32).reshape(L, n).tolist(), "sumsq": stats[:, 0].tolist(),
                      "writes": sink.writes(0), "n": n}))
""")


def _reference():
    import jax
    import jax.numpy as jnp

    L, D = 3, 15
    w = np.asarray(jax.random.normal(jax.random.key(0), (L, D, D), jnp.float32)) * 0.3
    x = np.asarray(jax.random.normal(jax.random.key(1), (4, D), jnp.float32))

    def net(w):
        def body(h, wl):
            return jnp.tanh(h @ wl), None
        h, _ = jax.lax.scan(body, jnp.asarray(x), w)
        return jnp.sum(h ** 2)

    loss, grad = jax.value_and_grad(net)(jnp.asarray(w))
    return float(loss), np.asarray(grad).reshape(L, -1)


def test_each_process_sinks_its_slice_of_the_summed_gradient():
    results = local_job(CHILD, 2)
    loss, grad = _reference()
    padded = np.pad(grad, ((0, 0), (0, 1)))  # 225 -> 226 = 2 x 113
    for code, out, err in results:
        assert code == 0, err[-3000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["n"] == 113 and r["writes"] == 3  # one slice per layer, nothing else
        mine = padded[:, r["index"] * 113:(r["index"] + 1) * 113]
        np.testing.assert_allclose(np.array(r["slices"]), mine, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["sumsq"], (grad.astype(np.float64) ** 2).sum(1), rtol=1e-4)  # global
        np.testing.assert_allclose(r["loss"], loss, rtol=1e-6)
