"""Device side of the instrumentation: the model probe, the statistics table, the weight-gradient hook.

The model calls `probe(site, x_BLD, layer)` at every instrumented tensor (`dsjax.models.transformer`):
sites 'embedding' (layer −1) and 'attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual' of every
layer of the scanned stack. `Instrument.value_and_grad` is `jax.value_and_grad` of the loss that also
measures, at every site,

  * forward: `stats.forward_stats(x)` (mean, var, corr_seq, corr_hidden, max_abs) and
  * backward: `stats.grad_stats(dL/dx)` (grad_var, grad_corr_seq),

plus per-layer weight-gradient statistics, and delivers them to the host `Collector` with
`jax.debug.callback`, tagged with the step.

How the per-layer statistics leave the layer scan: the probe passes x through an identity with a custom
VJP that also takes a zero "stats sink" array S of shape (depth + 1, sites, statistics). Its forward
rule computes the forward statistics (kept as residuals, a few scalars); its backward rule computes the
gradient statistics and returns, as the cotangent of S, a zero array holding this site's row at
S[layer + 1, site]. The gradient of the loss w.r.t. S is therefore exactly the table of all statistics
of all layers — each entry written once, by construction, whatever scan, remat or sharding do — and one
callback per step sends it to the host. We first delivered every site's statistics with its own
callback from inside the scan; that was reliable after de-duplication (remat runs forward callbacks
twice; see README.md), but it costs 8·depth + 2 host round trips per step (on an accelerator each one
inside the loop stalls the device) and doubled the overhead on CPU (13% vs 7%, default GPT config).

Usage (what `make_train_step(..., instrument=...)` does):

    loss, grads = instrument.value_and_grad(lambda params, probe: loss_fn(..., probe), params, step=step)
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
EMBEDDING_SITE = 'embedding'
LAYER_SITES = ('attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual')
SITES = (EMBEDDING_SITE,) + LAYER_SITES
ACTIVATION_STATS = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS


def _stats_vector(stats: dict[str, jax.Array], names: tuple[str, ...]) -> jax.Array:
  return jnp.stack([stats[name].astype(jnp.float32) for name in names])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stats_tap(site_index: int, sink_shape: tuple[int, ...], x_BLD: jax.Array, sink: jax.Array,
               layer: jax.Array) -> jax.Array:
  """Identity on x; d(loss)/d(sink) receives x's forward and gradient statistics at [layer+1, site]."""
  del site_index, sink_shape, sink, layer
  return x_BLD


def _stats_tap_fwd(site_index, sink_shape, x_BLD, sink, layer):
  del site_index, sink_shape, sink
  forward = _stats_vector(stats_lib.forward_stats(x_BLD), stats_lib.FORWARD_STATS)
  return x_BLD, (forward, layer)


def _stats_tap_bwd(site_index, sink_shape, residuals, g_BLD):
  forward, layer = residuals
  backward = _stats_vector(stats_lib.grad_stats(g_BLD), stats_lib.GRAD_STATS)
  row = jnp.concatenate([forward, backward])
  # One-hot products rather than a scatter at a traced index: plain elementwise ops, which the SPMD
  # partitioner handles inside the remat'ed, transposed layer scan (a scatter there deadlocked the
  # collectives of an 8-device CPU mesh).
  at_layer = jax.nn.one_hot(layer + 1, sink_shape[0], dtype=jnp.float32)
  at_site = jax.nn.one_hot(site_index, sink_shape[1], dtype=jnp.float32)
  sink_cotangent = at_layer[:, None, None] * at_site[None, :, None] * row[None, None, :]
  return g_BLD, sink_cotangent, None  # layer is an integer: no cotangent.


_stats_tap.defvjp(_stats_tap_fwd, _stats_tap_bwd)


def stack_depth(params: Any) -> int:
  layer_params = params
  for name in LAYER_STACK_PATH:
    layer_params = layer_params[name]
  return jax.tree.leaves(layer_params)[0].shape[0]


class Instrument:
  """Measures per-layer moments inside a jitted gradient computation; sends them to `collector`."""

  def __init__(self, collector: Collector, *, weights: bool = True):
    self.collector = collector
    self.weights = weights

  def value_and_grad(self, loss_fn: Callable[[Any, Probe], jax.Array], params: Any, *,
                     step: jax.Array) -> tuple[jax.Array, Any]:
    """`jax.value_and_grad(lambda p: loss_fn(p, probe))(params)`, recording the moments of `step`.

    `loss_fn(params, probe)` must hand `probe` to the model. Statistics are sent to the collector with
    one `jax.debug.callback` per group (activations, weight gradients), tagged with `step` (traced).
    """
    depth = stack_depth(params)
    sink = jnp.zeros((depth + 1, len(SITES), len(ACTIVATION_STATS)), jnp.float32)

    def loss_with_sink(params, sink):
      return loss_fn(params, self._probe(sink))

    loss, (grads, table) = jax.value_and_grad(loss_with_sink, argnums=(0, 1))(params, sink)
    step = jnp.asarray(step, jnp.int32)
    self._send_activation_table(step, table)
    if self.weights:
      self._send_weight_grads(step, grads)
    return loss, grads

  def _probe(self, sink: jax.Array) -> Probe:
    def probe(site: str, x_BLD: jax.Array, layer: jax.Array) -> jax.Array:
      if site not in SITES:
        raise ValueError(f'dsjax.instrument knows the probe sites {SITES}, got {site!r}')
      return _stats_tap(SITES.index(site), sink.shape, x_BLD, sink, jnp.asarray(layer, jnp.int32))
    return probe

  def _send_activation_table(self, step: jax.Array, table: jax.Array):
    """table: (depth + 1, sites, statistics); row 0 is the embedding, row n + 1 layer n."""
    depth = table.shape[0] - 1
    receive = self.collector.receive
    embedding_keys = tuple((EMBEDDING_SITE, name) for name in ACTIVATION_STATS)
    jax.debug.callback(receive, step, jnp.asarray(NO_LAYER), table[0, 0], keys=embedding_keys)
    layer_keys = tuple((site, name) for site in LAYER_SITES for name in ACTIVATION_STATS)
    values_KN = table[1:, 1:].reshape(depth, len(layer_keys)).T  # one row per (site, statistic)
    jax.debug.callback(receive, step, jnp.arange(depth), values_KN, keys=layer_keys)

  def _send_weight_grads(self, step: jax.Array, grads: Any):
    """Per-layer gradient norms and whole-stack heavy-tail statistics of each block weight type."""
    layer_grads = grads
    for name in LAYER_STACK_PATH:
      layer_grads = layer_grads[name]
    by_kind = stats_lib.weight_grad_stats(layer_grads)
    norm_keys = tuple((f'weight/{kind}', 'grad_norm') for kind in by_kind)
    norms_KN = jnp.stack([kind_stats.pop('grad_norm') for kind_stats in by_kind.values()])
    jax.debug.callback(self.collector.receive, step, jnp.arange(norms_KN.shape[1]), norms_KN,
                       keys=norm_keys)
    whole_stack = {(f'weight/{kind}', name): value.astype(jnp.float32)
                   for kind, kind_stats in by_kind.items() for name, value in kind_stats.items()}
    jax.debug.callback(self.collector.receive, step, jnp.asarray(NO_LAYER),
                       jnp.stack(list(whole_stack.values())), keys=tuple(whole_stack))


def is_instrumented_step(step: int, every: int) -> bool:
  """Loop steps that run the instrumented train step: the first (= the model at initialisation) and
  every `every`-th. `every = 0` turns instrumentation off."""
  return every > 0 and (step == 1 or step % every == 0)
