"""Per-layer moment instrumentation: forward and backward statistics of every layer (see probe.py)."""

from dsjax.instrument.collector import Collector, NO_LAYER, read_jsonl
from dsjax.instrument.probe import Instrument, SITES, is_instrumented_step
from dsjax.instrument.stats import FORWARD_STATS, GRAD_STATS, WEIGHT_TYPES, forward_stats, grad_stats, weight_grad_stats
