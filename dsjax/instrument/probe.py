"""Device side of the instrumentation: the model probe and the weight-gradient hook.

The model calls `probe(site, x_BLD, layer)` at every instrumented tensor (see
`dsjax.models.transformer`). The probe made here

  (a) computes `stats.forward_stats(x)` and sends them to the host with `jax.debug.callback`, and
  (b) returns x through an identity with a custom VJP whose backward pass computes
      `stats.grad_stats(dL/dx)` and sends those,

each tagged with (step, layer, site) so the host `Collector` can de-duplicate (remat re-runs forward
callbacks inside the backward pass) and order them. Only scalars cross to the host.

`Instrument.record_weight_grads` does the same for the parameter gradients of the layer stack.

Usage (what `make_train_step(..., instrument=...)` does):

    instrument = Instrument(collector)
    loss = loss_fn(model, batch, key, instrument.probe(step))       # activations, forward + backward
    instrument.record_weight_grads(step, grads)                     # per-layer weight gradients
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dsjax.instrument import stats as stats_lib
from dsjax.instrument.collector import NO_LAYER, Collector
from dsjax.models.transformer import Probe

# Where the stacked block parameters live in the params tree of both GPT and ViT.
LAYER_STACK_PATH = ('trunk', 'stack', 'layers')


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grad_tap(on_grad: Callable, x: jax.Array, step: jax.Array, layer: jax.Array) -> jax.Array:
  """Identity on x; the backward pass calls on_grad(step, layer, dL/dx) and passes the gradient on."""
  del on_grad, step, layer
  return x


def _grad_tap_fwd(on_grad, x, step, layer):
  del on_grad
  return x, (step, layer)


def _grad_tap_bwd(on_grad, residuals, g):
  step, layer = residuals
  on_grad(step, layer, g)
  return g, None, None  # step and layer are integers: no cotangent.


_grad_tap.defvjp(_grad_tap_fwd, _grad_tap_bwd)


class Instrument:
  """Makes probes and weight-gradient hooks that deliver statistics to `collector` via callbacks."""

  def __init__(self, collector: Collector, *, forward: bool = True, backward: bool = True,
               weights: bool = True):
    self.collector = collector
    self.forward, self.backward, self.weights = forward, backward, weights

  def probe(self, step: jax.Array) -> Probe:
    """A model probe for training step `step` (a traced int32 scalar)."""
    step = jnp.asarray(step, jnp.int32)

    def probe(site: str, x_BLD: jax.Array, layer: jax.Array) -> jax.Array:
      layer = jnp.asarray(layer, jnp.int32)
      if self.forward:
        # stop_gradient: the statistics are observations, never part of the differentiated graph.
        self._send(step, layer, site, stats_lib.forward_stats(jax.lax.stop_gradient(x_BLD)))
      if self.backward:
        x_BLD = _grad_tap(functools.partial(self._send_grad_stats, site), x_BLD, step, layer)
      return x_BLD

    return probe

  def _send_grad_stats(self, site: str, step: jax.Array, layer: jax.Array, g_BLD: jax.Array):
    self._send(step, layer, site, stats_lib.grad_stats(g_BLD))

  def _send(self, step: jax.Array, layer: jax.Array, site: str, stats: dict[str, jax.Array]):
    self._send_keyed(step, layer, {(site, name): value for name, value in stats.items()})

  def _send_keyed(self, step: jax.Array, layer: jax.Array, stats: dict[tuple[str, str], jax.Array]):
    """One callback carrying every {(site, stat): value}, packed into one float32 vector."""
    values = jnp.stack([v.astype(jnp.float32) for v in stats.values()])
    jax.debug.callback(self.collector.receive, step, layer, values, keys=tuple(stats))

  def record_weight_grads(self, step: jax.Array, grads: Any) -> None:
    """Sends per-layer gradient norms and heavy-tail statistics of each block weight type."""
    if not self.weights:
      return
    layer_grads = grads
    for name in LAYER_STACK_PATH:
      layer_grads = layer_grads[name]
    step = jnp.asarray(step, jnp.int32)
    by_kind = stats_lib.weight_grad_stats(layer_grads)
    # Two callbacks in all: per-layer norms (one row per weight type), then the whole-stack statistics.
    norm_keys = tuple((f'weight/{kind}', 'grad_norm') for kind in by_kind)
    norms_KN = jnp.stack([kind_stats.pop('grad_norm') for kind_stats in by_kind.values()])
    depth = norms_KN.shape[1]
    jax.debug.callback(self.collector.receive, step, jnp.arange(depth), norms_KN, keys=norm_keys)
    self._send_keyed(step, jnp.asarray(NO_LAYER), {
        (f'weight/{kind}', name): value for kind, kind_stats in by_kind.items()
        for name, value in kind_stats.items()})


def is_instrumented_step(step: int, every: int) -> bool:
  """Loop steps that run the instrumented train step: the first (= the model at initialisation) and
  every `every`-th. `every = 0` turns instrumentation off."""
  return every > 0 and (step == 1 or step % every == 0)
