"""Random ops at values every rank shares (runtime/randomness.py), found on the graph (passes.capturing.annotate.random_ops),
and verify's refusals of randomness it cannot fix (verify.check_randomness)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.errors import AutoshardError
from autoshard.ir.names import RANDOM_OPS, is_random
from autoshard.passes.capturing.annotate import random_ops
from autoshard.pipeline import capture_graph
from autoshard.runtime.model import load_model_file, zero_dropout_rates
from autoshard.runtime.randomness import RandomOpNotFixed, base_name, drawing_freely, fixable, fixed_randomness
from autoshard.show import random_ops_text
from autoshard.verify import check_randomness, forward_is_deterministic, random_ops_note

DROP_PATH = "tests/models/random_layers.py:build_drop_path"
RAND_MASK = "tests/models/random_layers.py:build_rand_mask"


def _tagged_random_ops() -> set[str]:
    """Every aten op torch registers (not only those this process has touched: ``dir(torch.ops.aten)`` holds
    the packets loaded so far) that it tags ``nondeterministic_seeded``."""
    found = set()
    names = {op.split("::", 1)[1] for op in torch._C._dispatch_get_all_op_names() if op.startswith("aten::")}
    for name in sorted(names):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            if torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags:
                found.add(base_name(name))
    return found


def test_the_graph_list_of_random_ops_holds_every_op_torch_tags_and_each_has_a_value():
    assert _tagged_random_ops() <= RANDOM_OPS  # a new torch's random op would be missed: add it and its value
    # refused when drawn: CUDA's internal dropout, and a nested-tensor softmax torch tags random
    assert {op for op in RANDOM_OPS if not fixable(op)} == {"_fused_dropout", "_nested_tensor_softmax_with_shape"}


def test_each_random_op_returns_its_expectation():
    with fixed_randomness():
        assert torch.equal(torch.rand(3), torch.full((3,), 0.5))
        assert torch.equal(torch.randn(2, 2), torch.zeros(2, 2))
        assert torch.equal(torch.empty(3).uniform_(2, 4), torch.full((3,), 3.0))
        assert torch.equal(torch.empty(2).normal_(1.5, 3), torch.full((2,), 1.5))
        assert torch.equal(torch.empty(4).bernoulli_(0.8), torch.full((4,), 0.8))
        assert torch.equal(torch.bernoulli(torch.tensor([0.2, 0.7])), torch.tensor([0.2, 0.7]))
        assert torch.equal(torch.empty(2, dtype=torch.bool).bernoulli_(0.7), torch.tensor([True, True]))
        assert torch.equal(torch.randint(0, 10, (3,)), torch.full((3,), 4))
        assert torch.equal(torch.randperm(4), torch.arange(4))
        assert torch.equal(torch.multinomial(torch.tensor([0.1, 0.6, 0.3]), 2), torch.tensor([1, 2]))
        assert torch.allclose(torch.empty(2).exponential_(4.0), torch.full((2,), 0.25))
        assert torch.equal(
            torch.binomial(torch.tensor([10.0, 4.0]), torch.tensor([0.3, 0.5])), torch.tensor([3.0, 2.0])
        )
        assert torch.allclose(torch._sample_dirichlet(torch.tensor([1.0, 3.0])), torch.tensor([0.25, 0.75]))
        with pytest.raises(RandomOpNotFixed, match="random_ without bounds"):
            torch.empty(2).random_()
        with drawing_freely():  # data draws as usual
            assert not torch.equal(torch.rand(64), torch.rand(64))
    assert not torch.equal(torch.rand(64), torch.full((64,), 0.5))  # the block ends the fix


def test_dropout_of_every_form_is_the_identity_with_the_identity_gradient():
    x = torch.randn(2, 4, 8, 16, requires_grad=True)
    mha = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
    assert zero_dropout_rates(nn.Sequential(nn.Dropout(0.3), mha)) == 2 and mha.dropout == 0.0
    mha.dropout = 0.5  # and with its rate left on: the dropout inside multi_head_attention_forward
    q = torch.randn(2, 5, 16)
    with fixed_randomness():
        assert torch.equal(nn.Dropout(0.5)(x), x) and torch.equal(F.dropout(x, 0.5, True), x)
        assert torch.equal(torch.ops.aten.dropout.default(x, 0.5, True), x)  # a traced pipeline stage's call
        torch.ops.aten.mul.Tensor(
            x, torch.ops.aten.bernoulli_.float(torch.empty_like(x), 0.6).div_(0.6)
        ).sum().backward()  # dropout as the CPU runs it, below the functions
        assert torch.allclose(x.grad, torch.ones_like(x))
        a = F.scaled_dot_product_attention(x, x, x, None, 0.9)
        b = F.scaled_dot_product_attention(x, x, x, dropout_p=0.9)
        first, second = mha(q, q, q)[0], mha(q, q, q)[0]
        assert torch.equal(first, second)
        assert torch.equal(F.rrelu(torch.tensor([-1.0]), 0.1, 0.3, True), torch.tensor([-0.2]))
    assert torch.equal(a, F.scaled_dot_product_attention(x, x, x)) and torch.equal(b, a)
    assert not torch.equal(F.dropout(x, 0.5, True), x)  # the fix ends with its block


def test_a_kernel_that_drops_out_inside_is_refused_by_name():
    q = torch.randn(1, 2, 4, 8)
    with fixed_randomness(), pytest.raises(RandomOpNotFixed, match="_scaled_dot_product_flash_attention_for_cpu"):
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.5)


def test_the_graph_names_each_random_op_and_its_modules(in_repo):
    _, drop_path = capture_graph(DROP_PATH, proofs=False)
    _, rand_mask = capture_graph(RAND_MASK, proofs=False)
    assert random_ops(drop_path) == {"aten.bernoulli_.float": ["blocks.*"]}
    assert random_ops(rand_mask) == {"aten.rand.default": ["(root)"], "aten.randn_like.default": ["(root)"]}
    assert not is_random("aten.dropout.default", {"p": 0.0, "train": True})  # a rate of 0 draws nothing
    assert not is_random("aten.scaled_dot_product_attention.default", {})
    assert is_random("aten.scaled_dot_product_attention.default", {"dropout_p": 0.1})
    text = random_ops_text(random_ops(rand_mask))
    assert "aten.rand.default in (root)" in text and "verify" in text
    assert "aten.bernoulli_.float in blocks.*" in random_ops_note(random_ops(drop_path))


def _plan(spec: str, random_ops: dict | None):
    model = {"spec": spec, **({"random_ops": random_ops} if random_ops is not None else {})}
    return SimpleNamespace(model=model, global_batch=4)


def test_verify_refuses_randomness_it_cannot_fix_naming_the_op_and_module(in_repo):
    check_randomness(_plan(DROP_PATH, {"aten.bernoulli_.float": ["blocks.*"]}), load_model_file(DROP_PATH), 0)
    with pytest.raises(AutoshardError, match=r"aten._fused_dropout.default \(in blocks.\*\)"):
        check_randomness(_plan(DROP_PATH, {"aten._fused_dropout.default": ["blocks.*"]}), load_model_file(DROP_PATH), 0)
    spec = "tests/bad_models/python_random.py:build"
    assert not forward_is_deterministic(load_model_file(spec), 4, 0)
    with pytest.raises(AutoshardError, match="Python's random"):
        check_randomness(_plan(spec, None), load_model_file(spec), 0)


def test_forwards_agree_once_random_ops_are_fixed(in_repo):
    for spec in (DROP_PATH, RAND_MASK):
        assert forward_is_deterministic(load_model_file(spec), 8, 0)


def test_the_note_for_a_plan_without_random_ops_does_not_call_it_old():
    note = random_ops_note(None)
    assert "lists no random op" in note and "predates" not in note
