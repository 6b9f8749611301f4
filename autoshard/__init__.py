"""autoshard: a compiler for distributed training.

plan = autoshard.plan("examples/gpt.py:build", cluster="local-cpu", global_batch=16)
p = autoshard.parallelize(model, plan)   # inside torchrun
loss = p.train_step(inputs, targets)     # then optimizer.step()
"""

from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan, load_plan
from autoshard.ir.recipe import Recipe

__version__ = "0.1.0"
__all__ = ["plan", "parallelize", "layout", "load_plan", "Plan", "Recipe", "AutoshardError", "__version__"]


def plan(*args, **kwargs):
    from autoshard.api import plan as _plan

    return _plan(*args, **kwargs)


def parallelize(*args, **kwargs):
    from autoshard.api import parallelize as _parallelize

    return _parallelize(*args, **kwargs)


def layout(*args, **kwargs):
    from autoshard.api import layout as _layout

    return _layout(*args, **kwargs)


plan.__doc__ = "Plan a model on a cluster; see autoshard.api.plan."
parallelize.__doc__ = "Apply a plan inside a torchrun-launched script; see autoshard.api.parallelize."
layout.__doc__ = "A plan's mesh and the axes its training loop reads; see autoshard.api.layout."
