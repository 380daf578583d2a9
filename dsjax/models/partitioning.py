"""Layout constraints of the model's activations, in logical axis names.

The model pins the batch axis of the activations it makes — the residual stream after the embedding,
every branch output and residual add of every layer (inside the layer scan), the logits — to the mesh
axes of the logical axis 'batch', and leaves their other axes to XLA's sharding propagation (GSPMD, Xu
et al. 2021, arXiv:2105.04663; e.g. the heads over 'tensor' inside attention). Without the pin the
propagation may shard the model width of an activation over 'fsdp' after the fsdp-sharded weights,
where fully sharded data parallelism means to gather the weights instead (ZeRO-3).

The logical names are mapped to mesh axes by Flax's logical axis rules (`flax.core.spmd`), which the
training run sets with its mesh (`dsjax.train.sharding.use_mesh`). Without a current mesh or without
rules (a model run on one device, as the CLIs that measure it do) a constraint is the identity.
"""

from __future__ import annotations

import math

import jax
from flax.core import spmd
from jax.sharding import PartitionSpec as P


def constrain_batch(x_B: jax.Array) -> jax.Array:
  """`x_B` (batch first, any rank ≥ 1) with its batch axis laid out by the logical axis 'batch', its
  other axes left to XLA; `x_B` itself without a mesh or without a rule for 'batch'."""
  return with_logical_layout(x_B, ('batch',) + (P.UNCONSTRAINED,) * (x_B.ndim - 1))


def with_logical_layout(x: jax.Array, axes: tuple) -> jax.Array:
  """`x` constrained to the layout of its logical `axes` (one entry per dimension: a logical name, None
  for a whole dimension, or `P.UNCONSTRAINED` for XLA's choice) under the current mesh and logical axis
  rules. A name without a rule, or whose mesh axes do not divide its dimension, keeps the dimension
  whole. The identity without a current mesh or without rules."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = dict(spmd.get_logical_axis_rules())
  if mesh.empty or not rules:
    return x
  spec = P(*(_mesh_axes(mesh, rules, a, n) for a, n in zip(axes, x.shape)))
  return jax.lax.with_sharding_constraint(x, spec)


def kernel_spec(what: str, dims: tuple[tuple[str | None, int], ...]) -> P | None:
  """The `jax.shard_map` spec that runs a kernel (`what`, for the error) per device on an array whose
  dimensions are `dims` = ((logical name or None, size), ...): each named dimension over the mesh axes
  its logical axis rule gives, kept whole where they do not divide it (each device then computes it
  all). None without a current mesh or on one device (no shard_map needed). A mesh of several devices
  with no rule for 'batch' is a ValueError: the kernel could not be told how the batch is laid out."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  rules = dict(spmd.get_logical_axis_rules())
  if 'batch' not in rules:
    raise ValueError(
      f"{what} on a mesh of {mesh.size} devices needs logical axis rules for 'batch': set them with "
      'flax.core.spmd.logical_axis_rules'
    )
  return P(*(_mesh_axes(mesh, rules, name, size) for name, size in dims))


def _mesh_axes(mesh, rules: dict, name, size: int):
  """The mesh axes of logical `name` where they divide `size`, else None (whole); None and
  P.UNCONSTRAINED stand for themselves."""
  if not isinstance(name, str):
    return name
  names = rules.get(name)
  names = (names,) if isinstance(names, str) else tuple(names or ())
  return names if names and size % math.prod(mesh.shape[n] for n in names) == 0 else None
