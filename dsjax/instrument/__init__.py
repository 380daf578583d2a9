"""Per-layer moment instrumentation: forward and backward statistics of every layer (see README.md)."""

from dsjax.instrument.collector import (
  MOMENTS_FILE,
  NO_LAYER,
  Collector,
  first_nonfinite,
  json_value,
  read_jsonl,
  start_host_copy,
)
from dsjax.instrument.monitor import (
  MONITOR_FILE,
  Monitor,
  monitor_config,
  validate_monitor_config,
)
from dsjax.instrument.probe import (
  SITES,
  PackedMoments,
  instrument_config,
  is_instrumented_step,
  pack_moments,
  validate_instrument_config,
  value_and_grad,
)
from dsjax.instrument.stats import (
  FORWARD_STATS,
  GRAD_STATS,
  WEIGHT_TYPES,
  forward_stats,
  grad_stats,
  weight_grad_stats,
)
