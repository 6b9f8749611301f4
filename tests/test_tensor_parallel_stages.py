"""TP inside pipeline stages: local shards whose collectives survive torch.export (one process, tp = 1)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from autoshard.errors import AutoshardError
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


class SeqBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential()
        self.mlp.up, self.mlp.act, self.mlp.down = nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class SeqModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.block, self.head = nn.Embedding(16, 8), SeqBlock(), nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


# Megatron's sequence parallelism on one block: sliced on entry, the norm on the shard, the MLP gathering its input
# once, the row linear reduce-scattering, the head gathering the tokens back
SEQ_STYLES = {
    "block": "scatter-seq-input-dim1",
    "block.norm": "sharded-input-dim1",
    "block.mlp": "gather-seq-module-input-dim1",
    "block.mlp.up": "colwise",
    "block.mlp.down": "rowwise-seq-output-dim1",
    "head": "colwise-gather-seq-input-dim1",
}


def test_sequence_parallel_styles_trace_their_ops_and_train_like_the_model(group):
    """The sequence styles' ops survive export; the column linear reading its module's gathered input takes no f
    (the gather's backward sums its partial gradient), while the norm's weights and the row bias, meeting this
    rank's tokens only, go through f. At tp = 1 every op is the identity, so values and gradients are the model's."""
    torch.manual_seed(0)
    reference, ids = SeqModel(), torch.randint(0, 16, (2, 6))
    sharded = SeqModel()
    sharded.load_state_dict(reference.state_dict())
    shard_for_tracing(sharded, group, SEQ_STYLES)
    graph = torch.export.export(sharded, (ids,), strict=False).graph_module.graph
    called = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert {"autoshard.sp_split.default", "autoshard.sp_gather.default", "autoshard.sp_scatter.default"} <= set(called)
    assert called.count("autoshard.tp_copy.default") == 3  # norm weight and bias, the row linear's bias
    reference(ids).square().sum().backward()
    sharded(ids).square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_gathered_input_no_column_linear_reads_as_it_is_is_refused(group):
    """The gather's backward reduce-scatters its readers' partial gradients: a module whose column linears read
    something else than the gathered tokens (here a copy of them) would sum them twice, so its trace is refused."""

    class Copying(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 8)

        def forward(self, x):
            return self.up(x * 1.0)

    model = nn.Sequential(Copying())
    shard_for_tracing(model, group, {"0": "gather-seq-module-input-dim1", "0.up": "colwise"})
    with pytest.raises(AutoshardError, match="read the tokens it gathered as they are"):
        model(torch.randn(2, 4, 8))
