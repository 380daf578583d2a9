"""Device mesh and parameter/batch shardings (the `jax.jit`-with-shardings form of pjit).

Mesh axes are ('data', 'fsdp', 'tensor'), shape from `config.mesh.shape` (-1 = all remaining
devices). The batch is split over data × fsdp. Parameters are sharded by *logical* axis names that
each parameter gets from its place in the model (table below), mapped to mesh axes by `AXIS_RULES`:
the model width ('embed') is split over fsdp (ZeRO-3 style), heads / FFN hidden / vocabulary over
tensor (Megatron style). A dimension that does not divide evenly is replicated instead.
Stacked block parameters carry a leading layer axis, which is never sharded.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')
AXIS_RULES = {'embed': 'fsdp', 'heads': 'tensor', 'mlp': 'tensor', 'vocab': 'tensor'}

# (parent name, leaf name) -> logical axes of the parameter without the stacked layer axis.
LOGICAL_AXES = {
    ('q', 'kernel'): ('embed', 'heads'), ('k', 'kernel'): ('embed', 'heads'),
    ('v', 'kernel'): ('embed', 'heads'), ('o', 'kernel'): ('heads', 'embed'),
    ('q', 'bias'): ('heads',), ('k', 'bias'): ('heads',), ('v', 'bias'): ('heads',),
    ('ffn1', 'kernel'): ('embed', 'mlp'), ('ffn2', 'kernel'): ('mlp', 'embed'), ('ffn1', 'bias'): ('mlp',),
    ('patch_embed', 'kernel'): (None, 'embed'),
    (None, 'token_embed'): ('vocab', 'embed'),
    ('head', 'kernel'): ('embed', 'vocab'), ('head', 'bias'): ('vocab',),
}


def resolve_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
  """Fills a single -1 and checks the product; errors name `mesh.shape`."""
  shape = tuple(int(s) for s in shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f'mesh.shape must have {len(MESH_AXES)} entries {MESH_AXES}, got {shape}')
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise ValueError(f'mesh.shape entries must be positive with at most one -1, got {shape}')
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f'mesh.shape {shape} does not divide the {num_devices} available devices')
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(f'mesh.shape {shape} needs {math.prod(shape)} devices, but {num_devices} are available')
  return shape


def make_mesh(shape, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape(shape, len(devices))
  # Auto axes: shardings given at the jit boundary propagate through the step (GSPMD), as pjit did.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _key_name(entry) -> str | None:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return None


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec of the parameter at `path` (names from the root) with `shape`."""
  logical = LOGICAL_AXES.get(tuple(path[-2:])) or LOGICAL_AXES.get((None, path[-1]))
  stacked = 'layers' in path
  if logical is None or len(logical) + stacked != len(shape):
    return P()
  spec = [None] * stacked
  for dim, name in zip(shape[stacked:], logical):
    axis = AXIS_RULES.get(name) if name else None
    spec.append(axis if axis and dim % mesh.shape[axis] == 0 else None)
  return P(*spec)


def tree_shardings(abstract_tree: Any, mesh: Mesh) -> Any:
  """NamedShardings for a tree of arrays (parameters, or anything holding parameter-shaped leaves).

  Leaves are matched by their path: optimizer moments live at paths that end with the parameter's
  path (e.g. ('opt_state', '0', 'mu', 'trunk', ..., 'kernel')), so they get the parameter's sharding.
  """
  def sharding(path, leaf):
    names = tuple(n for n in (_key_name(e) for e in path) if n is not None)
    shape = tuple(getattr(leaf, 'shape', ()))
    return NamedSharding(mesh, param_spec(names, shape, mesh))
  return jax.tree_util.tree_map_with_path(sharding, abstract_tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's share of the batch into global arrays sharded over data × fsdp."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
