"""Device mesh and parameter/batch/activation shardings (the `jax.jit`-with-shardings form of pjit).

Mesh axes are ('data', 'fsdp', 'tensor'), shape from `config.mesh.shape` (-1 = all remaining
devices). The batch is split over data × fsdp. Every model array declares its *logical* axes where it is
created (`axes=` metadata, `dsjax.models.layers.param`); `AXIS_RULES` maps them to mesh axes: the model
width ('embed') over fsdp (fully sharded data parallelism: ZeRO-3, Rajbhandari et al. 2020,
arXiv:1910.02054), attention width / FFN hidden / vocabulary over tensor (Megatron-LM, Shoeybi et al.
2019, arXiv:1909.08053); 'patch', 'seq' and None are replicated by decision. A dimension that does not
divide evenly over its mesh axis stays whole, by decision, and the training loop logs every such
parameter (`undivided_dimensions`: e.g. a 10-class head over a tensor axis of 4). Stacked block
parameters carry a leading layer axis, which is never sharded. The optimizer state is sharded like the
parameter each leaf belongs to. An array without
logical axes, a logical axis without a rule, or an optimizer-state leaf that matches no parameter is an
error, never a silent replication.

Activations: the model pins the batch axis of the residual stream at every layer and of its outputs
to the mesh axes of the logical axis 'batch' (`dsjax.models.partitioning`), and leaves their other axes
to XLA's sharding propagation (GSPMD, Xu et al. 2021, arXiv:2105.04663); model code that places
activations itself (a Pallas attention kernel, per device inside `jax.shard_map`) reads the mesh axes
of 'batch' and 'heads' as well. Both read them from Flax's logical axis rules
(`ACTIVATION_AXIS_RULES`), which `use_mesh` sets with the mesh. The train and eval steps
(`dsjax.train.loop`) pin the batch's rows to data × fsdp (`constrain_batch_axis`) and gather the
embedding tables and heads over fsdp before use (`gather_tables_over_fsdp`).

Several processes (`jax.distributed`, initialised by `dsjax.main` from `distributed_settings`): each
process reads its own rows of every global batch (`dsjax.data`), so every batch shard must live on the
devices of one process (`check_process_layout`).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, Mapping

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')
AXIS_RULES = {
  'embed': 'fsdp',
  'heads': 'tensor',
  'mlp': 'tensor',
  'vocab': 'tensor',
  'patch': None,
  'seq': None,
  None: None,
}
# Logical axes of activations, for the model code that lays them out (`dsjax.models.partitioning`, and the
# Pallas kernels that run per device inside `jax.shard_map`: the splash attention, `model.fused_ops`), as
# Flax's logical axis rules (`use_mesh`).
ACTIVATION_AXIS_RULES = (('batch', BATCH_AXES), ('heads', AXIS_RULES['heads']), ('mlp', AXIS_RULES['mlp']))


def mesh_config() -> ml_collections.ConfigDict:
  """The `mesh` config section (checked by `resolve_mesh_shape`; the run's checks also ask the tensor
  axis to divide model.num_heads, so that each device holds whole heads)."""
  c = ml_collections.ConfigDict()
  c.shape = (-1, 1, 1)  # (data, fsdp, tensor); -1 = all remaining devices
  return c


def resolve_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
  """Fills a single -1 and checks the product; errors name `mesh.shape`."""
  try:
    shape = tuple(int(s) for s in shape)
  except (TypeError, ValueError):
    raise ValueError(f'mesh.shape must be {len(MESH_AXES)} integers {MESH_AXES}, got {shape!r}') from None
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
  """The mesh of `mesh.shape` (checked, -1 resolved) over `devices` (default: all)."""
  devices = jax.devices() if devices is None else list(devices)
  return mesh_over(resolve_mesh_shape(shape, len(devices)), devices)


def mesh_over(shape: tuple[int, ...], devices) -> Mesh:
  """The mesh of a shape already resolved by `resolve_mesh_shape` over `devices`."""
  # Auto axes: shardings given at the jit boundary propagate through the step (GSPMD), as pjit did.
  mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
  check_process_layout(np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices))
  return mesh


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[None]:
  """`mesh` as the current mesh of the steps traced and run inside, with the activations' logical axis
  rules (`ACTIVATION_AXIS_RULES`) that the model code reads where it places arrays itself."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(ACTIVATION_AXIS_RULES):
    yield


def check_process_layout(process_of_device_DFT: np.ndarray):
  """With several processes, each batch shard (one data × fsdp position) must sit on the devices of one
  process, and every process must hold as many batch shards: a process feeds only its own rows of each
  batch (`global_batch`). `process_of_device_DFT`: the process index of each mesh device, in mesh
  shape. A ValueError naming mesh.shape otherwise."""
  processes = np.unique(process_of_device_DFT)
  if len(processes) == 1:
    return
  shape = tuple(process_of_device_DFT.shape)
  batch_shards = shape[0] * shape[1]
  process_of_shard_ST = process_of_device_DFT.reshape(batch_shards, shape[2])
  split = any(len(np.unique(row_T)) > 1 for row_T in process_of_shard_ST)
  shards_per_process = {int((process_of_shard_ST[:, 0] == p).sum()) for p in processes}
  if split or len(shards_per_process) > 1:
    raise ValueError(
      f'mesh.shape {shape} does not fit {len(processes)} processes of '
      f'{process_of_device_DFT.size // len(processes)} devices: each data×fsdp position '
      f'must sit in one process and each process hold as many; make data×fsdp '
      f'({batch_shards}) a multiple of the process count and tensor at most the devices '
      'per process'
    )


def _key_name(entry) -> str | None:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return None


def _names(path) -> tuple[str, ...]:
  return tuple(n for n in (_key_name(e) for e in path) if n is not None)


def logical_axes(abstract_model: nnx.Module) -> dict[tuple[str, ...], tuple[str | None, ...]]:
  """{path of every model array (as in the pure-dict state): its logical axes}; an error for any array
  that does not declare them."""
  axes = {}
  state = nnx.state(abstract_model)
  leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  for path, variable in leaves:
    names = _names(path)
    declared = variable.get_metadata().get('axes') if isinstance(variable, nnx.Variable) else None
    if declared is None:
      raise ValueError(
        f'model array {"/".join(names)} declares no logical axes (create it with '
        'dsjax.models.layers.param or .constant and axes=...)'
      )
    axes[names] = tuple(declared)
  return axes


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec of an array with `shape` whose trailing dimensions have logical `axes` (a leading
  extra dimension is the stacked layer axis, never sharded)."""
  stacked = len(shape) - len(axes)
  if stacked not in (0, 1):
    raise ValueError(f'logical axes {axes} do not fit an array of shape {shape}')
  spec = [None] * stacked
  for dim, name in zip(shape[stacked:], axes):
    if name not in AXIS_RULES:
      raise ValueError(f'logical axis {name!r} has no rule in dsjax.train.sharding.AXIS_RULES')
    axis = AXIS_RULES[name]
    spec.append(axis if axis and dim % mesh.shape[axis] == 0 else None)
  return P(*spec)


def undivided_dimensions(
  abstract_state: Any, model_axes: dict[tuple[str, ...], tuple], mesh: Mesh
) -> list[str]:
  """'path: axis size N kept whole (mesh axis M of size S)' for every parameter dimension whose rule
  names a mesh axis of more than one device that does not divide it, so `spec_for` leaves it whole."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state.get('params', {}))[0]:
    names = _names(path)
    if names not in model_axes:
      continue
    axes, shape = model_axes[names], tuple(leaf.shape)
    spec = spec_for(axes, shape, mesh)[len(shape) - len(axes) :]  # the per-layer dimensions
    for dim, name, given in zip(shape[len(shape) - len(axes) :], axes, spec):
      wanted = AXIS_RULES[name]
      if wanted and given is None:  # spec_for keeps an axis that divides (one of size 1 always does)
        found.append(
          f'{"/".join(names)}: {name} size {dim} kept whole ({wanted} axis of {mesh.shape[wanted]})'
        )
  return found


def state_shardings(abstract_state: Any, model_axes: dict[tuple[str, ...], tuple], mesh: Mesh) -> Any:
  """NamedShardings for the train state {'params', 'rest', 'opt_state', 'step'}.

  Model arrays get the sharding of their logical axes. Optimizer-state leaves live at paths that end
  with a parameter's path (e.g. ('opt_state', '1', '0', 'mu', 'trunk', ..., 'kernel')) and get that
  parameter's sharding; scalar leaves (counts, the step) are replicated by decision.
  """
  by_length = sorted({len(p) for p in model_axes}, reverse=True)

  def sharding(path, leaf):
    names, shape = _names(path), tuple(getattr(leaf, 'shape', ()))
    if names[:1] in (('params',), ('rest',)) and names[1:] in model_axes:
      return NamedSharding(mesh, spec_for(model_axes[names[1:]], shape, mesh))
    if names[:1] == ('opt_state',):
      for n in by_length:
        if len(names) > n and names[-n:] in model_axes:
          return NamedSharding(mesh, spec_for(model_axes[names[-n:]], shape, mesh))
    if shape == ():
      return NamedSharding(mesh, P())
    raise ValueError(
      f'train-state array {"/".join(names)} of shape {shape} matches no model array; '
      'give it a sharding rule in dsjax.train.sharding'
    )

  return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES))


def activation_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Axis 0 (the batch) over data × fsdp; the other axes unconstrained, for XLA to choose (e.g. heads
  over tensor inside attention). Pinning the batch axis keeps the propagation from sharding the model
  width of activations over fsdp after the fsdp-sharded weights, where fsdp is meant to gather the
  weights instead (ZeRO-3)."""
  return NamedSharding(mesh, P(BATCH_AXES, *([P.UNCONSTRAINED] * (ndim - 1))))


def constrain_batch_axis(x_B: jax.Array, mesh: Mesh) -> jax.Array:
  """`x_B` (batch first, any rank ≥ 1) with its batch axis constrained to data × fsdp."""
  return jax.lax.with_sharding_constraint(x_B, activation_sharding(mesh, x_B.ndim))


def gather_tables_over_fsdp(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """Constrains, in place, the arrays of `model` (merged inside a traced step) that have a 'vocab'
  axis — embedding tables and output heads — to their layout with fsdp gathered.

  Fully sharded data parallelism keeps a weight sharded over fsdp between uses and gathers it where
  it is used (ZeRO-3); XLA does so by itself for the matmul weights (for the stacked layers one layer
  at a time, inside the layer scan). Not for a lookup: a table sharded over fsdp on its model width
  makes the lookup come out sharded over fsdp on the width, which the batch sharding of the
  activations can only undo by replicating the whole batch's embeddings on every device (XLA:
  "Involuntary full rematerialization"), forward and backward. Gathered first, the lookup keeps the
  batch sharding of its indices."""
  for _, variable in nnx.iter_graph(model):
    if not isinstance(variable, nnx.Variable):
      continue
    axes, value = variable.get_metadata().get('axes'), variable.get_value()
    if axes is None or 'vocab' not in axes:
      continue
    spec = [None if axis == 'fsdp' else axis for axis in spec_for(tuple(axes), value.shape, mesh)]
    variable.set_value(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, P(*spec))))
  return model


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's share of the batch into global arrays sharded over data × fsdp."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


@jax.jit
def _max_vote(votes: jax.Array) -> jax.Array:
  return votes.max()


def max_over_processes(value: int, mesh: Mesh) -> jax.Array:
  """A decision every process of the run takes alike: a scalar device array holding the largest of the
  processes' `value`s (each mesh device votes its process's value; an all-reduce), e.g. 1 where any
  process says so. It is dispatched like any step, so a loop can read one step's vote (`read_vote`) a
  step later without waiting for the device."""
  votes = np.full((len(mesh.local_devices),), value, np.int32)
  return _max_vote(
    jax.make_array_from_process_local_data(NamedSharding(mesh, P(MESH_AXES)), votes, (mesh.devices.size,))
  )


def read_vote(vote: jax.Array) -> int:
  """The value of a `max_over_processes` vote, from this process's copy of the replicated scalar."""
  return int(np.asarray(vote.addressable_data(0)))


# ------------------------------------------------------------------------------------------------
# Several processes: jax.distributed from flags or the environment (dsjax.main).
# ------------------------------------------------------------------------------------------------

# flag name → the environment variable it defaults to.
DISTRIBUTED_ENV = {
  'coordinator_address': 'JAX_COORDINATOR_ADDRESS',
  'num_processes': 'JAX_NUM_PROCESSES',
  'process_id': 'JAX_PROCESS_ID',
}
_NEEDED = (
  'a multi-process run needs --coordinator_address, --num_processes and --process_id (or '
  'JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID), or --jax_distributed to detect '
  'them on a Cloud TPU pod, SLURM or Open MPI'
)


def _int_setting(name: str, flag_value: int | None, environ: Mapping[str, str], least: int):
  """(value, where it came from) of an integer setting: its flag, else its environment variable."""
  if flag_value is not None:
    where, value = f'--{name}={flag_value}', flag_value
  elif environ.get(DISTRIBUTED_ENV[name], '').strip():
    raw = environ[DISTRIBUTED_ENV[name]].strip()
    where = f'{DISTRIBUTED_ENV[name]}={raw}'
    try:
      value = int(raw)
    except ValueError:
      raise ValueError(f'{where}: expected an integer ≥ {least}') from None
  else:
    return None, None
  if value < least:
    raise ValueError(f'{where}: expected an integer ≥ {least}')
  return value, where


def distributed_settings(
  coordinator_address: str | None,
  num_processes: int | None,
  process_id: int | None,
  detect: bool,
  environ: Mapping[str, str] = os.environ,
) -> dict | None:
  """The keyword arguments of `jax.distributed.initialize` that the flags (or their environment
  variables) ask for; None for a single-process run. A ValueError naming the flag (or variable) for a
  value that cannot work, or a multi-process run that misses one of them without `detect`."""
  settings, where = {}, {}
  address = coordinator_address or environ.get(DISTRIBUTED_ENV['coordinator_address'], '').strip() or None
  if address is not None:
    where['coordinator_address'] = (
      f'--coordinator_address={address}' if coordinator_address else f'JAX_COORDINATOR_ADDRESS={address}'
    )
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise ValueError(
        f'{where["coordinator_address"]}: expected HOST:PORT with a port in 1…65535, '
        'e.g. 10.0.0.1:1234 (the address of process 0)'
      )
    settings['coordinator_address'] = address
  for name, value, least in (('num_processes', num_processes, 1), ('process_id', process_id, 0)):
    value, where[name] = _int_setting(name, value, environ, least)
    if value is not None:
      settings[name] = value
  if (
    'process_id' in settings
    and 'num_processes' in settings
    and (settings['process_id'] >= settings['num_processes'])
  ):
    raise ValueError(
      f'{where["process_id"]}: must be below the number of processes ({where["num_processes"]})'
    )
  if detect:
    return settings
  if not settings:
    return None
  missing = [f'--{name}' for name in DISTRIBUTED_ENV if name not in settings]
  if missing:
    raise ValueError(f'{" and ".join(missing)} not given: {_NEEDED}')
  return settings


def initialize_distributed(settings: dict, detect: bool):
  """`jax.distributed.initialize(**settings)` (JAX detects what is missing from the cluster when
  `detect`), before anything touches a device. On CPU the processes exchange collectives through Gloo
  (the default of jax 0.10 on CPU, named here so that a CPU run does not depend on the default;
  JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi still chooses MPI)."""
  if not os.environ.get('JAX_CPU_COLLECTIVES_IMPLEMENTATION'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    jax.distributed.initialize(**settings)
  except (ValueError, RuntimeError) as e:
    reason = ' '.join(str(e).split()) or type(e).__name__
    if detect:
      raise ValueError(
        f'--jax_distributed: JAX could not set up the processes ({reason}); outside a Cloud '
        'TPU pod, SLURM or Open MPI give --coordinator_address, --num_processes and '
        '--process_id'
      ) from None
    given = ' '.join(f'--{k}={v}' for k, v in settings.items())
    raise ValueError(f'jax.distributed.initialize with {given} failed: {reason}') from None
