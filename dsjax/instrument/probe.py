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
VJP that also takes a zero "stats sink" array. Its forward rule keeps x's statistics as residuals; its
backward rule computes the gradient's and returns them as the cotangent of the sink. The gradient of
the loss w.r.t. the sink is therefore a table of all statistics of all layers: every entry written
exactly once by construction, whatever scan, remat or sharding do, with no change to the model beyond
its probe hook. Two sinks:

  * a stacked model's layer sites tap a sink of their own layer, (sites, B, size), entry n of a
    (depth, sites, B, size) array that the layer scan carries in with the layer parameters (a
    `ScannedProbe`). What a site returns there are the partial sums its statistics come from
    (`stats.forward_sums`, `stats.grad_sums`: sums over tokens and over hidden units, per example),
    which leave the backward scan as that layer's output; after the loop all layers' and sites'
    statistics are finished from them at once. Why: on a GPU every small reduction to a scalar is a
    kernel launch of its own, per site and layer (benchmarks/README.md, "Compiled for a GPU on the
    CPU"). When every layer probes each of its sites once, in one order, the forward sums of a layer's
    sites are kept for its backward pass together, by the tap of its last site (one residual per
    layer, not four). The sums' shapes and the sites' order come from one more trace of the model,
    without compute;
  * the embedding (outside the stack), and the layers of a model that does not stack them
    (`models.concat`), tap the (depth + 1, sites, statistics) table itself: a site returns its
    finished statistics at [layer + 1, site], zero elsewhere.

The identity keeps the probed dtype (a bfloat16 activation returns its bfloat16 cotangent unchanged);
the statistics are float32 whatever that dtype (`stats.py`, "Numerics"), and so are the sinks.

By default the table is returned from the jitted step and handed to the host `Collector` by the
caller; the train step returns the step's moments packed into one vector (`PackedMoments`), fetched to
the host in one transfer rather than one per array. `instrument.delivery='callback'` (a `receiver` for
`value_and_grad`) sends the statistics with `jax.debug.callback` instead. On one device the whole table
goes in one callback per step, once the backward pass has filled it. On a mesh of several devices each
probe sends its own from its backward rule (its forward statistics kept as residuals until then),
tagged with (step, layer, site): one callback after the scan can deadlock a multi-device step.
Why returning is the default, with the evidence for each choice, is in README.md.
"""

from __future__ import annotations

import collections.abc
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from dsjax.instrument import stats as stats_lib
from dsjax.models.config import one_of
from dsjax.models.partitioning import constrain_batch, with_logical_layout
from dsjax.models.transformer import Probe, ScannedProbe

# Where the stacked block parameters live in the params tree of both GPT and ViT.
LAYER_STACK_PATH = ('trunk', 'stack', 'layers')
EMBEDDING_SITE = 'embedding'
LAYER_SITES = ('attn_branch', 'attn_residual', 'ffn_branch', 'ffn_residual')
SITES = (EMBEDDING_SITE,) + LAYER_SITES
ACTIVATION_STATS = stats_lib.FORWARD_STATS + stats_lib.GRAD_STATS
# instrument.delivery: the statistics table returned from the step, or sent by jax.debug.callback.
DELIVERIES = ('return', 'callback')
# The name every operation of the statistics carries in the compiled program's metadata (its op_name):
# a profile or a program compiled for a GPU then tells the statistics' kernels from the step's own
# (benchmarks/hlo_traffic.py, which names it too). The taps' rules and the work after the backward pass
# run inside it.
STATISTICS_SCOPE = 'instrument_statistics'


def statistics_scope(fn: Callable) -> Callable:
  """`fn` traced inside `jax.named_scope(STATISTICS_SCOPE)`."""

  @functools.wraps(fn)
  def scoped(*args, **kwargs):
    with jax.named_scope(STATISTICS_SCOPE):
      return fn(*args, **kwargs)

  return scoped


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


@jax.tree_util.register_pytree_node_class
class PackedMoments(collections.abc.Mapping):
  """One step's `Moments` as one float32 vector, for their trip from the device to the host: fetched
  array by array, the ~50 arrays of a step's moments cost the host one transfer each (on a 2-core CPU
  half of making the step's records at 12 layers: benchmarks/README.md, "Instrumentation overhead").
  Reads as the `Moments` mapping it holds, on the device or, after `jax.device_get`, on the host."""

  def __init__(self, flat: Any, layout: tuple[Any, tuple[tuple[int, ...], ...]]):
    self.flat, self.layout = flat, layout  # layout: the moments' treedef and each leaf's shape
    self._moments: Moments | None = None

  def tree_flatten(self):
    return (self.flat,), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], layout)

  def unpack(self) -> Moments:
    """The `Moments` tree: each leaf a slice of the vector in its own shape (a view, on the host)."""
    if self._moments is None:
      treedef, shapes = self.layout
      sizes = [math.prod(shape) for shape in shapes]
      starts = np.cumsum([0, *sizes[:-1]], dtype=int)
      leaves = [self.flat[a : a + size].reshape(shape) for a, size, shape in zip(starts, sizes, shapes)]
      self._moments = jax.tree.unflatten(treedef, leaves)
    return self._moments

  def __getitem__(self, key: str) -> Any:
    return self.unpack()[key]

  def __iter__(self):
    return iter(self.unpack())

  def __len__(self) -> int:
    return len(self.unpack())


def pack_moments(moments: Moments) -> PackedMoments:
  """`moments` (float32 statistics) concatenated into one float32 vector, in the order of their leaves."""
  leaves, treedef = jax.tree.flatten(moments)
  flat = jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves] or [jnp.zeros(0)])
  return PackedMoments(flat, (treedef, tuple(tuple(leaf.shape) for leaf in leaves)))


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


@statistics_scope
def _stats_tap_fwd(site_index, sink_shape, x_BLD, sink, layer, sample_rows):
  del site_index, sink_shape, sink
  return x_BLD, (_forward_row(x_BLD, sample_rows), layer)


@statistics_scope
def _stats_tap_bwd(site_index, sink_shape, sample_rows, residuals, g_BLD):
  forward, layer = residuals
  row = _site_row(forward, g_BLD, sample_rows)
  # A select rather than a scatter at a traced index: plain elementwise ops, cheap at this size and
  # easy for the SPMD partitioner inside the transposed layer scan (and, unlike a one-hot product,
  # a NaN stays in its own entry).
  at_layer = jnp.arange(sink_shape[0]) == layer + 1
  at_site = jnp.arange(sink_shape[1]) == site_index
  sink_cotangent = jnp.where((at_layer[:, None] & at_site[None, :])[:, :, None], row[None, None, :], 0.0)
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


# Inside a stacked model's layer scan the layer sites tap a sink of their layer instead (its entry of a
# `ScannedProbe`'s per-layer array, (sites, B, size)): the cotangent of a site's row is the site's
# partial sums in that layer, packed per example ((B, size): the forward sums, then the gradient's),
# which leave the backward scan as that layer's output; the statistics of all layers and sites are then
# finished from them at once after the loop (`stats.forward_stats_of_sums`, `grad_stats_of_sums`).
# Every partial sum has the batch as its first axis, and the rows keep it: on a mesh they stay split
# over the devices as the batch is.


def _pack(sums: dict[str, jax.Array]) -> jax.Array:
  """Partial sums (each (B, n)) side by side, (B, Σn), in the order of their names."""
  return jnp.concatenate([sums[name] for name in sorted(sums)], axis=-1)


def _unpack(packed: jax.Array, like: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
  """`_pack` undone on the last axis of `packed` (..., B, Σn), leading axes kept."""
  out, start = {}, 0
  for name in sorted(like):
    width = like[name].shape[-1]
    out[name] = packed[..., start : start + width]
    start += width
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sums_tap(site_index: int, sample_rows: int, x_BLD: jax.Array, layer_sink: jax.Array) -> jax.Array:
  """Identity on x; d(loss)/d(layer_sink)[site_index] receives the packed partial sums of x and of its
  gradient (site_index: in LAYER_SITES)."""
  del site_index, sample_rows, layer_sink
  return x_BLD


@statistics_scope
def _sums_tap_fwd(site_index, sample_rows, x_BLD, layer_sink):
  del site_index, layer_sink
  return x_BLD, _pack(stats_lib.forward_sums(x_BLD, sample_rows))


@statistics_scope
def _sums_tap_bwd(site_index, sample_rows, forward_sums_BF, g_BLD):
  grad_sums_BF = _pack(stats_lib.grad_sums(g_BLD, sample_rows))
  return g_BLD, _site_row_ct(site_index, forward_sums_BF, grad_sums_BF)


def _at_site(site_index: int) -> jax.Array:
  """(LAYER_SITES, 1, 1) mask of one site's entry in a layer sink."""
  return (jnp.arange(len(LAYER_SITES)) == site_index)[:, None, None]


def _site_row_ct(site_index: int, forward_BF: jax.Array, grad_BF: jax.Array) -> jax.Array:
  """The layer sink's cotangent with one site's row (forward sums, then the gradient's) and zeros.

  One sink per layer for its four sites, rather than one each: XLA writes their rows into the scan's
  output in one kernel, not four. A select, not a one-hot product, so that a NaN stays in its own
  site's row."""
  row_BF = constrain_batch(jnp.concatenate([forward_BF, grad_BF], axis=-1))
  return jnp.where(_at_site(site_index), row_BF[None], 0.0)


_sums_tap.defvjp(_sums_tap_fwd, _sums_tap_bwd)


# When a layer calls each of its sites once, in an order known beforehand (`_layer_sites`), the forward
# sums of its sites are kept for the backward pass together: the tap of every site but the layer's last
# hands its forward sums on as an output and writes only its gradient's sums (`_grad_sums_tap`); the
# last one keeps the forward sums of all of them, stacked (sites, B, size), as the one residual of its
# tap (`_layer_sums_tap`), whose backward rule writes all the forward rows. Why: each residual of the
# layer scan is written into a stacked buffer of its own, a kernel per residual and layer on a GPU
# (benchmarks/README.md, "Compiled for a GPU on the CPU": 3 kernels per layer fewer at 192 × 256).


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grad_sums_tap(
  site_index: int, sample_rows: int, forward_size: int, x_BLD: jax.Array, layer_sink: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(x, the packed forward sums of x); d(loss)/d(layer_sink)[site_index] receives the packed partial
  sums of x's gradient (after `forward_size` zeros, where the layer's last site writes x's own). The
  sums are an output of no derivative: the layer's last site keeps them."""
  return _grad_sums_tap_fwd(site_index, sample_rows, forward_size, x_BLD, layer_sink)[0]


@statistics_scope
def _grad_sums_tap_fwd(site_index, sample_rows, forward_size, x_BLD, layer_sink):
  del site_index, forward_size, layer_sink
  return (x_BLD, _pack(stats_lib.forward_sums(x_BLD, sample_rows))), None


@statistics_scope
def _grad_sums_tap_bwd(site_index, sample_rows, forward_size, residuals, cotangents):
  del residuals
  g_BLD, _ = cotangents  # the sums' cotangent is zero: they only reach the statistics
  grad_BF = _pack(stats_lib.grad_sums(g_BLD, sample_rows))
  zeros_BF = jnp.zeros((grad_BF.shape[0], forward_size), grad_BF.dtype)
  return g_BLD, _site_row_ct(site_index, zeros_BF, grad_BF)


_grad_sums_tap.defvjp(_grad_sums_tap_fwd, _grad_sums_tap_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layer_sums_tap(
  site_index: int, sample_rows: int, x_BLD: jax.Array, layer_sink: jax.Array, earlier_SBF: jax.Array
) -> jax.Array:
  """Identity on x, the layer's last site; d(loss)/d(layer_sink) receives the forward sums of every site
  of the layer (`earlier_SBF` for the others, zeros where a site was not probed; x's own at
  site_index) and x's gradient's sums at site_index. `earlier_SBF` gets no cotangent."""
  del site_index, sample_rows, layer_sink, earlier_SBF
  return x_BLD


@statistics_scope
def _layer_sums_tap_fwd(site_index, sample_rows, x_BLD, layer_sink, earlier_SBF):
  del layer_sink
  own_BF = constrain_batch(_pack(stats_lib.forward_sums(x_BLD, sample_rows)))
  return x_BLD, jnp.where(_at_site(site_index), own_BF[None], earlier_SBF)


@statistics_scope
def _layer_sums_tap_bwd(site_index, sample_rows, forward_SBF, g_BLD):
  grad_BF = _pack(stats_lib.grad_sums(g_BLD, sample_rows))
  grad_SBF = jnp.where(_at_site(site_index), grad_BF[None], 0.0)
  layer_sink_ct = with_logical_layout(
    jnp.concatenate([forward_SBF, grad_SBF], axis=-1), (P.UNCONSTRAINED, 'batch', P.UNCONSTRAINED)
  )
  return g_BLD, layer_sink_ct, None


_layer_sums_tap.defvjp(_layer_sums_tap_fwd, _layer_sums_tap_bwd)


def _layer_sites(loss_fn, params) -> tuple[tuple[int, ...] | None, int | None]:
  """From a trace of `loss_fn`'s model without compute: the shape of the tensors at its layer sites (all
  alike in a stacked model, whatever their dtypes; None if they differ), and the index in LAYER_SITES
  of a layer's last site if every layer probes each of its sites once in one order (None otherwise)."""
  shapes, order = set(), []

  def record(site, x_BLD, layer):
    if site != EMBEDDING_SITE:
      shapes.add(x_BLD.shape)
      order.append(LAYER_SITES.index(site) if site in LAYER_SITES else -1)
    return x_BLD

  jax.eval_shape(lambda params: loss_fn(params, record), params)
  shape = next(iter(shapes)) if len(shapes) == 1 else None
  # A scanned stack traces its layer once; an unrolled one repeats the layer's order per layer.
  per_layer = order[: len(set(order))]
  repeated = per_layer and order == per_layer * (len(order) // len(per_layer)) and -1 not in per_layer
  return shape, (per_layer[-1] if repeated else None)


def _sums_like(shape: tuple[int, ...], sample_rows: int) -> tuple[dict, dict]:
  """The shapes of `stats.forward_sums` and `stats.grad_sums` of a probed tensor of `shape`."""
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  return tuple(
    jax.eval_shape(functools.partial(sums, sample_rows=sample_rows), x)
    for sums in (stats_lib.forward_sums, stats_lib.grad_sums)
  )


def _scanned_sink_probe(
  sink: jax.Array, layer_sink: jax.Array, sample_rows: int, last_site: int | None, forward_size: int
) -> ScannedProbe:
  """The probe of a stacked model: the embedding into `sink`, layer n's sites into `layer_sink[n]`;
  with `last_site` (in LAYER_SITES) the forward sums of a layer's sites leave with its last site's tap,
  otherwise with each site's own."""

  def in_layer(layer_sink_n: jax.Array) -> Probe:
    forward_sums = {}  # this layer's sites probed so far: LAYER_SITES index -> packed sums (B, size)

    def tap(site_index, x_BLD, layer):
      site = LAYER_SITES.index(SITES[site_index])
      if last_site is None:
        return _sums_tap(site, sample_rows, x_BLD, layer_sink_n)
      if site != last_site:
        x_BLD, sums_BF = _grad_sums_tap(site, sample_rows, forward_size, x_BLD, layer_sink_n)
        forward_sums[site] = constrain_batch(sums_BF)
        return x_BLD
      zeros_BF = jnp.zeros((x_BLD.shape[0], forward_size), jnp.float32)
      earlier_SBF = jnp.stack([forward_sums.get(n, zeros_BF) for n in range(len(LAYER_SITES))])
      return _layer_sums_tap(site, sample_rows, x_BLD, layer_sink_n, earlier_SBF)

    return _probe_with(tap)

  return ScannedProbe(outside=_sink_probe(sink, sample_rows), per_layer=layer_sink, in_layer=in_layer)


@statistics_scope
def _layer_table(sums_NSBF: jax.Array, like: tuple[dict, dict], tokens: int) -> jax.Array:
  """(depth, LAYER_SITES, ACTIVATION_STATS) statistics from the packed partial sums (depth, LAYER_SITES,
  B, size) the layer sink received (`_sums_tap_bwd`: the forward ones, then the gradient's); `tokens`:
  the tokens per example the sums are over."""
  forward_like, grad_like = like
  forward_size = sum(s.shape[-1] for s in forward_like.values())
  forward = stats_lib.forward_stats_of_sums(_unpack(sums_NSBF[..., :forward_size], forward_like))
  grad = stats_lib.grad_stats_of_sums(_unpack(sums_NSBF[..., forward_size:], grad_like), tokens)
  both = {**forward, **grad}
  return jnp.stack([both[name] for name in ACTIVATION_STATS], axis=-1)


def _sink_value_and_grad(loss_fn, params, sample_rows: int) -> tuple[jax.Array, Any, jax.Array]:
  """(loss, grads, the statistics table) through the stats sinks: the layer sites of a stacked model
  by their per-layer partial sums, finished after the loop; the embedding, and the layers of a model
  whose layers are not stacked, in the sink of scalars."""
  depth = stack_depth(params)
  sink = jnp.zeros((depth + 1, len(SITES), len(ACTIVATION_STATS)), jnp.float32)
  shape, last_site = _layer_sites(loss_fn, params) if layer_trees(params)[1] else (None, None)
  if shape is None:
    loss, (grads, table) = jax.value_and_grad(
      lambda params, sink: loss_fn(params, _sink_probe(sink, sample_rows)), argnums=(0, 1)
    )(params, sink)
    return loss, grads, table
  like = _sums_like(shape, sample_rows)
  forward_size, grad_size = (sum(s.shape[-1] for s in sums.values()) for sums in like)
  layer_sink = jnp.zeros((depth, len(LAYER_SITES), shape[0], forward_size + grad_size), jnp.float32)
  probe = functools.partial(
    _scanned_sink_probe, sample_rows=sample_rows, last_site=last_site, forward_size=forward_size
  )
  loss, (grads, table, sums_NSBF) = jax.value_and_grad(
    lambda params, sink, layer_sink: loss_fn(params, probe(sink, layer_sink)),
    argnums=(0, 1, 2),
  )(params, sink, layer_sink)
  tokens = stats_lib.sample_positions_per_example(shape[0], shape[1], sample_rows)
  return loss, grads, table.at[1:, 1:].add(_layer_table(sums_NSBF, like, tokens))


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


@statistics_scope
def _callback_tap_fwd(site_index, receiver, x_BLD, step, layer, sample_rows):
  # The forward statistics wait, as a few scalars, for the backward rule's callback: one host round
  # trip per site instead of two, and none from the forward pass that remat re-runs in the backward.
  del site_index, receiver
  return x_BLD, (_forward_row(x_BLD, sample_rows), step, layer)


@statistics_scope
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
    loss, grads, table = _sink_value_and_grad(loss_fn, params, sample_rows)
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
    with jax.named_scope(STATISTICS_SCOPE):
      moments['weights'] = stats_lib.weight_grad_stats(*layer_trees(grads), sample_rows=sample_rows)
  return loss, grads, moments


def is_instrumented_step(step: int, every: int) -> bool:
  """Loop steps that run the instrumented train step: the first (= the model at initialisation) and
  every `every`-th. `every = 0` turns instrumentation off."""
  return every > 0 and (step == 1 or step % every == 0)
