"""The instant-offload step does not widen the whole bf16 layer stack to fp32 on the CPU backend
(see ``offload_step.stacked_as_bits``), and the views it passes in share the parameters' buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxascend.config import load_config
from jaxascend.models import build_model, next_token_loss
from jaxascend.offload.raw_bits import stacked_as_bits
from jaxascend.offload.step import LeafRoutes, make_offload_step

LAYERS, HIDDEN, MLP = 3, 64, 192


def _loss(model, tokens, layer_hook):
    return next_token_loss(model(tokens[:, :-1], layer_hook=layer_hook), tokens)


def _model(remat):
    cfg = load_config("configs/tiny.yaml", [
        f"model.hidden_size={HIDDEN}", f"model.intermediate_size={MLP}", f"model.num_hidden_layers={LAYERS}",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.dtype=bfloat16",
        f"model.remat={remat}"])
    model = build_model(cfg.model, 97, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), rest


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the fp32 widening is XLA's CPU float normalization")
def test_no_fp32_copy_of_a_layer_stack():
    graphdef, params, rest = _model("full")
    routing = LeafRoutes.for_params(params, "layers")
    step = make_offload_step(graphdef, rest, routing, 1, _loss)  # compiled only: the sink is never called
    tokens = jax.ShapeDtypeStruct((1, 17), jnp.int32)
    hlo = step.lower(params, tokens, jax.ShapeDtypeStruct((), jnp.float32)).compile().as_text()
    for stack in (f"[{LAYERS},{HIDDEN},{MLP}]", f"[{LAYERS},{MLP},{HIDDEN}]"):
        assert f"u16{stack}" in hlo  # the stack enters as raw bits...
        assert f"f32{stack}" not in hlo and f"bf16{stack}" not in hlo  # ...and is never copied or widened


def test_stacked_as_bits_shares_buffers_and_names_dtypes():
    _, params, _ = _model("none")
    routing = LeafRoutes.for_params(params, "layers")
    bits, dtypes = stacked_as_bits(params, routing)
    stacked = {r.key for r in routing.routes if r.layers}
    assert {k for k, _ in dtypes} == stacked and all(d == "bfloat16" for _, d in dtypes)
    for before, after, route in zip(jax.tree.leaves(params), jax.tree.leaves(bits), routing.routes):
        if route.layers:
            assert after.dtype == jnp.uint16 and after.unsafe_buffer_pointer() == before.unsafe_buffer_pointer()
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before).view(np.uint16))
        else:
            assert after is before
