"""SlimFit: the schedule, its defaults, gradients, errors, the optimizer hooks' lifecycle, new weights."""
