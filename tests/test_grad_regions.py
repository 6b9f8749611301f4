"""Grad-mode regions inlined into a traced graph (runtime.grad_regions), as the pipeline split takes them."""

import pytest
import torch
import torch.fx as fx

from autoshard.errors import AutoshardError
from autoshard.runtime.grad_regions import REGION, check_balanced, inline_grad_mode_regions, set_grad_mode
from tests.models import no_grad_gate


def _exported_gate():
    torch.manual_seed(0)
    model = no_grad_gate.build()
    (x,), _ = no_grad_gate.example_batch(4)
    return model, x, torch.export.export(model, (x,))


def _modes(graph: fx.Graph) -> list[bool]:
    return [n.args[0] for n in graph.nodes if n.op == "call_function" and n.target is set_grad_mode]


def test_inlined_regions_compute_the_same_and_pass_no_gradient_to_what_they_read():
    """Each block's gate is computed under no_grad from its weights: inlined, the graph holds no region, computes the
    eager model's output, and the gates' weights get no gradient while the rest get the eager gradients."""
    model, x, program = _exported_gate()
    assert inline_grad_mode_regions(program.graph_module) == 4
    assert not any(n.target is REGION for n in program.graph_module.graph.nodes)
    assert _modes(program.graph_module.graph) == [False, True] * 4
    inlined = program.module(check_guards=False)
    torch.testing.assert_close(inlined(x), model(x), rtol=0, atol=0)
    model(x).square().sum().backward()
    inlined(x).square().sum().backward()
    for (name, eager), (_, traced) in zip(model.named_parameters(), inlined.named_parameters()):
        if ".gate." in name:
            assert eager.grad is None and traced.grad is None, name
        else:
            torch.testing.assert_close(traced.grad, eager.grad, rtol=0, atol=0)


def test_the_mode_is_put_back_to_gradients_on_whatever_mode_the_split_ran_in():
    _, _, program = _exported_gate()
    with torch.no_grad():
        inline_grad_mode_regions(program.graph_module)
    assert _modes(program.graph_module.graph) == [False, True] * 4


def test_a_stage_that_ends_inside_a_region_is_refused_in_one_line():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(set_grad_mode, (False,))
    graph.output(graph.call_function(torch.neg, (x,)))
    split = torch.nn.Module()
    split.submod_0 = fx.GraphModule(torch.nn.Module(), graph)
    with pytest.raises(AutoshardError, match="stage submod_0 ends with gradients off") as raised:
        check_balanced(split, "the pipeline split")
    assert len(str(raised.value).splitlines()) == 1
