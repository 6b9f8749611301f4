"""A zero-bubble split backward on a pipeline stage of the example GPT, with and without full recompute.

    python benchmarks/experiments/split_backward_stage.py [MODEL]

Splits the model one block per stage (``runtime.pipeline_parallel.split_model``), takes stage 1 (not the first:
its input needs a gradient) and runs its backward as torch's zero-bubble schedules do: the inputs' gradient
(``stage_backward_input``), then the weights' (``stage_backward_weight``, one ``autograd`` call per parameter
group), counting the matmuls each pass runs, and times it (median of 30) against one backward call. With full
recompute (``runtime.stage_recompute``) the weight pass reruns the block once per parameter group. One thread.
"""

from __future__ import annotations

import copy
import sys

import torch
from stage_recompute_cost import median_ms  # benchmarks/, run as a script
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.pipeline import capture_graph
from autoshard.runtime.model import build_model, load_model_file
from autoshard.runtime.pipeline_parallel import split_model
from autoshard.runtime.stage_recompute import apply_recompute_to_stage

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def main(spec: str) -> None:
    torch.set_num_threads(1)
    model_file = load_model_file(spec)
    model = build_model(model_file, seed=0, device=torch.device("cpu"))
    inputs, _ = model_file.example_batch(4)
    blocks = [b.path for b in capture_graph(spec, use_cache=True, proofs=False)[1].blocks]
    stages = split_model(copy.deepcopy(model), inputs, blocks[1:]).split_gm
    x = first(stages.submod_pp_0(*inputs)).detach().requires_grad_(True)
    print(f"torch {torch.__version__}; stage 1 ({blocks[1]}), matmuls run by each pass:")
    print("| recompute | forward | input pass | weight pass | parameter groups | one backward call | split |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("none", "full"):
        stage = copy.deepcopy(stages.submod_pp_1)
        if mode != "none":
            apply_recompute_to_stage(stage, {blocks[1]: mode})
        with CountMatmuls() as counter:
            out = first(stage(x))
            forward = counter.count
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
            input_pass = counter.count - forward
            stage_backward_weight(stage.parameters(), groups)
            weight_pass = counter.count - forward - input_pass

        def one_call(stage=stage):
            out = first(stage(x))
            out.backward(torch.ones_like(out))

        def split(stage=stage):
            out = first(stage(x))
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], stage.parameters())
            stage_backward_weight(stage.parameters(), groups)

        one_ms, split_ms = median_ms(one_call, calls=30), median_ms(split, calls=30)
        print(
            f"| {mode} | {forward} | {input_pass} | {weight_pass} | {len(groups)} | {one_ms:.2f} ms | {split_ms:.2f} ms |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/gpt.py:build")
