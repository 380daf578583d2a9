"""Signal-propagation theory of transformers (DSLM, Kedia et al. 2024, §3.5 and Appendices A–G, M).

    from dsjax.theory import Stats, GradStats, components, model

`components`: closed-form moments of every component and block; `model`: whole-model propagation,
rank-collapse fixed point and the DSLM correlation recurrence; `python -m dsjax.theory.verify`
checks the component formulas against Monte Carlo simulation (the paper's Table 21).
Pure NumPy/SciPy: importing this package does not import JAX or Flax.
"""

from dsjax.theory import components, model
from dsjax.theory.components import GradStats, Stats

__all__ = ['Stats', 'GradStats', 'components', 'model']
