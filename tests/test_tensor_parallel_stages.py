"""TP inside pipeline stages: local shards whose collectives survive torch.export (one process, tp = 1)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.runtime.tensor_parallel_stages import param_shard_dims, shard_for_tracing


@pytest.fixture(scope="module")
def group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.new_group([0])
    if owned:
        dist.destroy_process_group()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.up(self.emb(ids)))))


STYLES = {"emb": "vocab-parallel-embedding", "up": "colwise", "down": "rowwise", "head": "colwise-gather"}


def test_sharded_model_matches_and_export_keeps_the_collectives(group):
    torch.manual_seed(0)
    model, ids = Mlp(), torch.randint(0, 16, (2, 5))
    expected = model(ids)
    dims = shard_for_tracing(model, group, STYLES)
    assert dims == {"emb.weight": 0, "up.weight": 0, "up.bias": 0, "down.weight": 1, "head.weight": 0}
    torch.testing.assert_close(model(ids), expected)
    graph = torch.export.export(model, (ids,), strict=False).graph_module.graph
    called = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert {"autoshard.tp_copy.default", "autoshard.tp_reduce.default", "autoshard.tp_gather.default"} <= called


def test_local_shards_keep_the_modules_attributes(group):
    """The model's code may read a sharded module's attributes (Whisper: ``arange(embed_positions.num_embeddings)``):
    a local shard keeps the whole module's, as parallelize_module does, and the TP proof assumes."""
    model = Mlp()
    model.emb.padding_idx = 3
    shard_for_tracing(model, group, STYLES)
    assert (model.emb.num_embeddings, model.emb.embedding_dim, model.emb.padding_idx) == (16, 8, 3)
    assert (model.up.in_features, model.up.out_features, model.head.out_features) == (8, 32, 16)


def test_gradients_flow_through_the_custom_ops(group):
    torch.manual_seed(0)
    reference, ids = Mlp(), torch.randint(0, 16, (2, 5))
    sharded = Mlp()
    sharded.load_state_dict(reference.state_dict())
    shard_for_tracing(sharded, group, STYLES)
    reference(ids).square().sum().backward()
    sharded(ids).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_shard_dims_of_each_style():
    assert param_shard_dims("conv1d-colwise") == {"weight": 1, "bias": 0}
