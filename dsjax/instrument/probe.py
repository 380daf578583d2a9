"""Device side of the instrumentation: the model probe and the per-step statistics it produces.

The model calls `probe(site, x_BLD, layer)` at every instrumented tensor (`dsjax.models.transformer`):
sites 'embedding' (layer −1) and 'attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual' of every
layer of the scanned stack. `value_and_grad(loss_fn, params)` is `jax.value_and_grad` of the loss that
also returns the step's moments:

  * at every site, forward `stats.forward_stats(x)` (mean, var, corr_seq, corr_hidden, max_abs) and
    backward `stats.grad_stats(dL/dx)` (grad_var, grad_corr_seq);
  * per block weight type, per-layer gradient norms and whole-stack heavy-tail statistics;
  * with `instrument.sample_rows` > 0, all but max |x| and the norms from a fixed sample of rows
    (`stats.take_rows`, `stats.take_layer_rows`).

How the per-layer statistics leave the layer scan: the probe passes x through an identity with a custom
VJP that also takes a zero "stats sink" array of shape (depth + 1, sites, statistics). Its forward rule
computes the forward statistics (kept as residuals: a few scalars); its backward rule computes the
gradient statistics and returns, as the cotangent of the sink, this site's row at [layer + 1, site]
(zero elsewhere). The gradient of the loss w.r.t. the sink is therefore the table of all statistics of
all layers: every entry written exactly once by construction, whatever scan, remat or sharding do,
with no change to the model beyond its probe hook. The identity keeps the probed dtype (a bfloat16
activation returns its bfloat16 cotangent unchanged); the statistics are float32 whatever that dtype
(`stats.py`, "Numerics"), and so is the sink.

By default the table is returned from the jitted step and handed to the host `Collector` by the
caller. `instrument.delivery='callback'` (a `receiver` for `value_and_grad`) sends the statistics with
`jax.debug.callback` instead. On one device the whole table goes in one callback per step, once the
backward pass has filled it. On a mesh of several devices each probe sends its own from its backward
rule (its forward statistics kept as residuals until then), tagged with (step, layer, site): one
callback after the scan can deadlock a multi-device step.
Why returning is the default, with the evidence for each choice, is in README.md.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections

from dsjax.instrument import stats as stats_lib
from dsjax.models.config import one_of
from dsjax.models.transformer import Probe

# Where the stacked block parameters live in the params tree of both GPT and ViT.
LAYER_STACK_PATH = ('trunk', 'stack', 'layers')
EMBEDDING_SITE = 'embedding'
LAYER_SITES = ('attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual')
SITES = (EMBEDDING_SITE,) + LAYER_SITES
ACTIVATION_STATS = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS
# instrument.delivery: the statistics table returned from the step, or sent by jax.debug.callback.
DELIVERIES = ('return', 'callback')


def instrument_config() -> ml_collections.ConfigDict:
  """The `instrument` config section."""
  c = ml_collections.ConfigDict()
  c.every = 0  # steps between per-layer moment records; 0 = off (nothing compiled)
  c.delivery = 'return'  # 'return': statistics returned from the jitted step | 'callback':
  # sent by jax.debug.callback, on one device the step's table in
  # one callback, on several each probe site from inside the layer
  # scan (dsjax/instrument/README.md: why, and why 'return' is the
  # default)
  c.sample_rows = 0  # > 0: each site's statistics (max |x| aside) from ~this many fixed
  # (example, token) rows, and the weight-gradient distributions
  # from ~this many rows per leaf; 0 = whole tensors
  # (docs/instrumentation.md, "Sampled statistics")
  return c


def validate_instrument_config(c) -> None:
  if isinstance(c.every, bool) or not isinstance(c.every, int) or c.every < 0:
    raise ValueError(f'instrument.every must be an integer >= 0 (0 = off), got {c.every!r}')
  one_of('instrument.delivery', c.delivery, DELIVERIES)
  rows = c.sample_rows
  if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
    raise ValueError(f'instrument.sample_rows must be an integer >= 0 (0 = whole tensors), got {rows!r}')


# Moments of one step: {'activations': (depth + 1, len(SITES), len(ACTIVATION_STATS)) table, row 0 the
# embedding and row n + 1 layer n; 'weights': {weight type: {'grad_norm': (depth,), statistic: ()}}}.
Moments = dict[str, Any]


def _stats_vector(stats: dict[str, jax.Array], names: tuple[str, ...]) -> jax.Array:
  return jnp.stack([stats[name].astype(jnp.float32) for name in names])


def _forward_row(x_BLD: jax.Array, sample_rows: int) -> jax.Array:
  return _stats_vector(stats_lib.forward_stats(x_BLD, sample_rows), stats_lib.FORWARD_STATS)


def _grad_row(g_BLD: jax.Array, sample_rows: int) -> jax.Array:
  return _stats_vector(stats_lib.grad_stats(g_BLD, sample_rows), stats_lib.GRAD_STATS)


def _site_row(forward_row: jax.Array, g_BLD: jax.Array, sample_rows: int) -> jax.Array:
  """A probe site's statistics in ACTIVATION_STATS order: its forward ones, then its gradient's."""
  return jnp.concatenate([forward_row, _grad_row(g_BLD, sample_rows)])


def _probe_with(tap: Callable[[int, jax.Array, jax.Array], jax.Array]) -> Probe:
  """The model's probe(site, x, layer), checking the site and calling tap(site_index, x, layer)."""

  def probe(site: str, x_BLD: jax.Array, layer: jax.Array) -> jax.Array:
    if site not in SITES:
      raise ValueError(f'dsjax.instrument knows the probe sites {SITES}, got {site!r}')
    return tap(SITES.index(site), x_BLD, jnp.asarray(layer, jnp.int32))

  return probe


# ------------------------------------------------------------------------------------------------
# Delivery in a stats sink returned from the step (instrument.delivery='return', default).
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 5))
def _stats_tap(
  site_index: int,
  sink_shape: tuple[int, ...],
  x_BLD: jax.Array,
  sink: jax.Array,
  layer: jax.Array,
  sample_rows: int = 0,
) -> jax.Array:
  """Identity on x; d(loss)/d(sink) receives x's forward and gradient statistics at [layer+1, site]."""
  del site_index, sink_shape, sample_rows, sink, layer
  return x_BLD


def _stats_tap_fwd(site_index, sink_shape, x_BLD, sink, layer, sample_rows):
  del site_index, sink_shape, sink
  return x_BLD, (_forward_row(x_BLD, sample_rows), layer)


def _stats_tap_bwd(site_index, sink_shape, sample_rows, residuals, g_BLD):
  forward, layer = residuals
  row = _site_row(forward, g_BLD, sample_rows)
  # One-hot products rather than a scatter at a traced index: plain elementwise ops, cheap at this
  # size and easy for the SPMD partitioner inside the transposed layer scan.
  at_layer = jax.nn.one_hot(layer + 1, sink_shape[0], dtype=jnp.float32)
  at_site = jax.nn.one_hot(site_index, sink_shape[1], dtype=jnp.float32)
  sink_cotangent = at_layer[:, None, None] * at_site[None, :, None] * row[None, None, :]
  return g_BLD, sink_cotangent, None  # layer is an integer: no cotangent.


_stats_tap.defvjp(_stats_tap_fwd, _stats_tap_bwd)


def layer_trees(tree: Any) -> tuple[Any, bool]:
  """The block parameters (or their gradients) of a model's trunk, and whether they are stacked: the
  scanned stack at LAYER_STACK_PATH, or one subtree per layer at ('trunk', 'layers', n) when the layers
  differ in width (a concatenation residual)."""
  if 'stack' in tree['trunk']:
    for name in LAYER_STACK_PATH:
      tree = tree[name]
    return tree, True
  layers = tree['trunk']['layers']
  return [layers[k] for k in sorted(layers, key=int)], False


def stack_depth(params: Any) -> int:
  layers, stacked = layer_trees(params)
  return jax.tree.leaves(layers)[0].shape[0] if stacked else len(layers)


def _sink_probe(sink: jax.Array, sample_rows: int) -> Probe:
  return _probe_with(
    lambda site_index, x_BLD, layer: _stats_tap(site_index, sink.shape, x_BLD, sink, layer, sample_rows)
  )


# ------------------------------------------------------------------------------------------------
# Delivery by `jax.debug.callback` (instrument.delivery='callback').
# ------------------------------------------------------------------------------------------------

# A receiver of the statistics by callback (`Collector` is one), every argument a host numpy array:
#   receive(step, layer, site_index, values): one probe site's statistics (ACTIVATION_STATS order);
#   receive_table(step, table): the whole (depth + 1, sites, statistics) table of a step.
Receiver = Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 5))
def _callback_tap(
  site_index: int,
  receiver: Receiver,
  x_BLD: jax.Array,
  step: jax.Array,
  layer: jax.Array,
  sample_rows: int = 0,
) -> jax.Array:
  """Identity on x; in the backward pass sends x's forward and gradient statistics to `receiver`,
  tagged with (step, layer, site)."""
  del site_index, receiver, sample_rows, step, layer
  return x_BLD


def _callback_tap_fwd(site_index, receiver, x_BLD, step, layer, sample_rows):
  # The forward statistics wait, as a few scalars, for the backward rule's callback: one host round
  # trip per site instead of two, and none from the forward pass that remat re-runs in the backward.
  del site_index, receiver
  return x_BLD, (_forward_row(x_BLD, sample_rows), step, layer)


def _callback_tap_bwd(site_index, receiver, sample_rows, residuals, g_BLD):
  forward, step, layer = residuals
  jax.debug.callback(receiver.receive, step, layer, site_index, _site_row(forward, g_BLD, sample_rows))
  return g_BLD, None, None  # step and layer are integers: no cotangents.


_callback_tap.defvjp(_callback_tap_fwd, _callback_tap_bwd)


def _callback_probe(receiver: Receiver, step: jax.Array, sample_rows: int) -> Probe:
  step = jnp.asarray(step, jnp.int32)
  return _probe_with(
    lambda site_index, x_BLD, layer: _callback_tap(site_index, receiver, x_BLD, step, layer, sample_rows)
  )


def value_and_grad(
  loss_fn: Callable[[Any, Probe], jax.Array],
  params: Any,
  *,
  weights: bool = True,
  receiver: Receiver | None = None,
  step: jax.Array | None = None,
  per_site: bool = True,
  sample_rows: int = 0,
) -> tuple[jax.Array, Any, Moments]:
  """(loss, grads, moments): `jax.value_and_grad(lambda p: loss_fn(p, probe))(params)` plus the moments.

  `loss_fn(params, probe)` must hand `probe` to the model; every probe site must be visited once per
  layer (as `dsjax.models.transformer` does). `weights=False` skips the weight-gradient statistics.

  Delivery of the per-site activation statistics: by default the (depth + 1, sites, statistics) table
  `moments['activations']` (the stats sink, module docstring). With a `receiver` (e.g. a `Collector`)
  they are instead sent by `jax.debug.callback`, tagged with `step` (the loop step), and `moments`
  holds only the weight statistics, which stay returned. `per_site=False` (a step on one device)
  sends the whole table in one callback after the backward pass; `per_site=True` (the only safe
  choice on a mesh of several devices, where a callback after the scan can deadlock: README.md) sends
  each site's statistics from inside the layer scan, in the backward pass: 4 callbacks per layer.

  `sample_rows` > 0 (instrument.sample_rows): the statistics of each site, max |x| aside, come from a
  fixed sample of about that many of its (example, token) rows (`stats.take_rows`), and the weight
  types' distribution statistics from about that many rows of each leaf (`stats.take_layer_rows`).
  """
  if receiver is not None and step is None:
    raise ValueError('value_and_grad(receiver=...) needs the step that tags the records')
  if receiver is None or not per_site:
    sink = jnp.zeros((stack_depth(params) + 1, len(SITES), len(ACTIVATION_STATS)), jnp.float32)
    loss, (grads, table) = jax.value_and_grad(
      lambda params, sink: loss_fn(params, _sink_probe(sink, sample_rows)), argnums=(0, 1)
    )(params, sink)
    if receiver is None:
      moments = {'activations': table}
    else:
      jax.debug.callback(receiver.receive_table, jnp.asarray(step, jnp.int32), table)
      moments = {}
  else:
    loss, grads = jax.value_and_grad(
      lambda params: loss_fn(params, _callback_probe(receiver, step, sample_rows))
    )(params)
    moments = {}
  if weights:
    moments['weights'] = stats_lib.weight_grad_stats(*layer_trees(grads), sample_rows=sample_rows)
  return loss, grads, moments


def is_instrumented_step(step: int, every: int) -> bool:
  """Loop steps that run the instrumented train step: the first (= the model at initialisation) and
  every `every`-th. `every = 0` turns instrumentation off."""
  return every > 0 and (step == 1 or step % every == 0)
