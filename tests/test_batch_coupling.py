"""A loss that couples the samples of a batch is found at plan time (passes/capturing/batch_coupling.py), and the planner
keeps such a batch whole on one rank or refuses in one line."""

import pytest

import autoshard
from autoshard.errors import AutoshardError
from autoshard.passes.capturing.batch_coupling import coupling_reason
from autoshard.runtime.model import load_model_file

CONTRASTIVE = "tests/models/contrastive.py:build"
SUMMED = "tests/models/contrastive.py:build_summed"


def test_the_check_tells_a_coupled_loss_a_summed_loss_and_a_mean(in_repo):
    assert "couples the samples" in coupling_reason(load_model_file(CONTRASTIVE))
    assert "a sum over the batch" in coupling_reason(load_model_file(SUMMED))
    assert coupling_reason(load_model_file("tests/models/mlp.py:build")) == ""
    assert coupling_reason(load_model_file("tests/models/random_layers.py:build_drop_path")) == ""  # random, but a mean
    assert coupling_reason(load_model_file("tests/models/bn_cnn.py:build")) == ""  # BatchNorm is synced by the program


def test_the_planner_keeps_a_coupled_batch_whole_or_refuses_in_one_line(in_repo):
    plan = autoshard.plan(CONTRASTIVE, cluster="local-cpu", global_batch=8, devices_per_node=2)
    assert plan.mesh.dp == 1 and plan.num_microbatches == 1 and plan.world_size == 2
    assert any("couples the samples" in note for note in plan.notes)
    for pins in (dict(dp=2), dict(dp=1, tp=1, pp=2, microbatch_size=2)):
        with pytest.raises(AutoshardError, match="couples the samples of a batch") as refused:
            autoshard.plan(CONTRASTIVE, cluster="local-cpu", global_batch=8, devices_per_node=2, **pins)
        assert "\n" not in str(refused.value) and "--dp 1" in str(refused.value)
    mean_loss = autoshard.plan(
        "tests/models/mlp.py:build", cluster="local-cpu", global_batch=8, devices_per_node=2, dp=2
    )
    assert mean_loss.mesh.dp == 2 and not any("batch stays whole" in note for note in mean_loss.notes)


def test_a_check_that_would_take_long_runs_on_a_reduced_copy_or_not_at_all(in_repo, monkeypatch):
    """The check's work is read off the captured graph before anything runs: the same folded (its layers copied back)
    or not, growing with the tokens. Over ``MAX_CHECK_FLOPS`` the whole model is not run: a copy with its repeated
    layers cut to three is, at the model's own tokens, its own work held to the same bounds. Over
    ``MAX_CHECK_VALUE_BYTES`` (a tensor the tokens make, which the copy keeps) nothing is: ``batch_coupling`` is None
    (the plan's notes say it was not checked)."""
    from autoshard.passes.capturing import batch_coupling
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    model_file = load_model_file("examples/gpt.py:build")
    folded, whole = (annotate(capture(model_file, 2, fold)) for fold in (True, False))
    assert folded.fold is not None and len(folded.nodes) < len(whole.nodes)
    flops, largest_bytes = batch_coupling.check_work(folded)
    assert (flops, largest_bytes) == batch_coupling.check_work(whole) and flops > 0 and largest_bytes > 0
    shorter = annotate(capture(load_model_file("examples/gpt.py:build", seq_len=whole.tokens_per_sample // 2), 2, True))
    shorter_flops, shorter_bytes = batch_coupling.check_work(shorter)
    assert 2 * shorter_flops <= flops and shorter_bytes < largest_bytes

    assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling == ""  # within the bounds: run
    real = batch_coupling.coupling_reason
    copies = []

    def on_the_copy_only(source, *args, model=None, **kwargs):
        assert model is not None, "the whole model was run"
        copies.append((source.seq_len, len(model.get_submodule(folded.fold.path))))
        return real(source, *args, model=model, **kwargs)

    monkeypatch.setattr(batch_coupling, "coupling_reason", on_the_copy_only)
    with monkeypatch.context() as m:
        m.setattr(batch_coupling, "MAX_CHECK_FLOPS", flops - 1)
        assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling == ""
    assert copies == [(None, folded.fold.first + 3)]
    with monkeypatch.context() as m:
        m.setattr(batch_coupling, "MAX_CHECK_VALUE_BYTES", largest_bytes - 1)
        assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling is None
    monkeypatch.setattr(batch_coupling, "MAX_CHECK_FLOPS", 0)  # no copy is within it
    assert batch_coupling.check_batch_coupling(model_file, folded).batch_coupling is None
    assert len(copies) == 1


def test_layers_of_one_structure_but_other_settings_are_not_cut():
    """A stack whose layers have one structure but not one setting (here a flag that mixes the batch in one layer,
    as expert-choice routing would) is not cut: the copy would lose the layer that couples the samples."""
    import torch.nn as nn

    from autoshard.passes.capturing.reduced_copy import cut_stacks

    class Block(nn.Module):
        def __init__(self, index: int, mixes: bool):
            super().__init__()
            self.layer_idx, self.mixes_batch = index, mixes  # the index differs in every layer: not a setting
            self.proj = nn.Linear(8, 8)

    def stack(flagged: int | None) -> nn.Module:
        model = nn.Module()
        model.layers = nn.ModuleList(Block(i, i == flagged) for i in range(6))
        return model

    plain, flagged = stack(None), stack(4)
    assert cut_stacks(plain) == [("layers", 3, 6)] and len(plain.layers) == 3
    assert cut_stacks(flagged) == [] and len(flagged.layers) == 6


def test_a_setting_equal_to_the_index_in_one_layer_only_is_a_setting_and_other_plain_types_are_compared():
    """The layer's own index is no setting only where every layer holds its index there (``layer_idx``): 16 heads in
    layer 16 of 20 are the same setting as in the others, so the stack is cut; a tuple, an enum or None that differs
    in one layer keeps the stack whole."""
    import enum

    import torch.nn as nn

    from autoshard.passes.capturing.reduced_copy import cut_stacks

    class Kind(enum.Enum):
        DENSE, ROUTED = 1, 2

    class Block(nn.Module):
        def __init__(self, index: int, **odd):
            super().__init__()
            self.layer_idx, self.n_heads, self.kind, self.window, self.scale = index, 16, Kind.DENSE, (4, 4), None
            vars(self).update(odd)
            self.proj = nn.Linear(8, 8)

    def stack(layers: int = 20, **odd) -> nn.Module:
        model = nn.Module()
        model.layers = nn.ModuleList(Block(i, **(odd if i == 16 else {})) for i in range(layers))
        return model

    deep = stack()
    assert cut_stacks(deep) == [("layers", 3, 20)] and len(deep.layers) == 3
    for odd in (dict(window=(4, 8)), dict(kind=Kind.ROUTED), dict(scale=0.5), dict(n_heads=8)):
        assert cut_stacks(stack(**odd)) == [], odd


@pytest.mark.parametrize(
    "factory, cut",
    [("build_parent", True), ("build_parent_last", True), ("build_object", True), ("build_tuple", False)],
)
def test_a_copy_is_trusted_to_hold_only_where_the_graphs_prove_the_cut_layers_run_as_the_kept(
    in_repo, monkeypatch, factory, cut
):
    """Six layers of one structure, one coupling the batch by the parent's branch on the layer's index (after layer 4,
    or after the last), by an object no setting shows, or by a tuple setting: over the bounds, a copy that kept three
    layers would find no coupling. The copy's graph with the cut layers copied back is not the whole model's, so the
    model is not checked (None), never found to hold (""); the tuple setting keeps the stack whole (no copy)."""
    from autoshard.passes.capturing import batch_coupling, reduced_copy
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    model_file = load_model_file(f"tests/models/deep_mix.py:{factory}")
    assert "couples the samples" in coupling_reason(model_file)  # run whole
    graph = annotate(capture(model_file, 2, True))
    monkeypatch.setattr(batch_coupling, "MAX_CHECK_FLOPS", batch_coupling.check_work(graph)[0] - 1)
    made = reduced_copy.reduced_copy(model_file, graph.batch_size)
    assert (made is not None) == cut
    if cut:
        assert made.cut == [("layers", 3, 6)] and coupling_reason(model_file, model=made.model) == ""  # the trap
        assert not reduced_copy.runs_like_the_whole(model_file, graph, made.graph, made.cut)
    assert batch_coupling.check_batch_coupling(model_file, graph).batch_coupling is None


def test_a_copy_of_layers_proven_alike_holds_on_a_folded_or_whole_capture(in_repo, monkeypatch):
    """The same six layers, none coupling: the copy's graph with the cut layers copied back is op for op the whole
    model's, against the whole model captured again (the plan's graph folded) or the plan's own (not folded)."""
    from autoshard.passes.capturing import batch_coupling
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    model_file = load_model_file("tests/models/deep_mix.py:build")
    for fold in (True, False):
        graph = annotate(capture(model_file, 2, fold))
        assert (graph.fold is not None) == fold
        monkeypatch.setattr(batch_coupling, "MAX_CHECK_FLOPS", batch_coupling.check_work(graph)[0] - 1)
        assert batch_coupling.check_batch_coupling(model_file, graph).batch_coupling == ""


def test_a_contrastive_model_over_the_whole_check_s_bounds_is_found_on_its_reduced_copy(in_repo):
    """transformers' CLIP with two towers of 12 layers at width 1,024: 1.2 GB of weights, over ``MAX_CHECK_BYTES``;
    checked on the copy with each tower cut to 3 layers, its weights made by replaying the factory's."""
    from autoshard.passes.capturing import batch_coupling
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    model_file = load_model_file("tests/models/hf_clip.py:build_deep")
    weights = sum(p.numel() for p in model_file.build("meta").parameters())
    assert 4 * weights > batch_coupling.MAX_CHECK_BYTES
    graph = batch_coupling.check_batch_coupling(model_file, annotate(capture(model_file, 2, True)))
    assert "couples the samples" in graph.batch_coupling and "3 of 12" in graph.batch_coupling


def test_an_hf_model_over_the_bounds_is_checked_on_its_architecture_narrowed(tmp_path, monkeypatch):
    """``hf:DIR`` over the bounds: the same transformers architecture at width 64 (``narrowing.narrowed_config``), its
    other settings kept; ``MAX_CHECK_BYTES`` set below the tiny model stands for a model over it."""
    import transformers

    from autoshard.narrowing import NARROW_SIZES, narrowed_config
    from autoshard.passes.capturing import batch_coupling
    from autoshard.passes.capturing.annotate import annotate
    from autoshard.passes.capturing.capture import capture

    config = transformers.LlamaConfig(
        hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=5,
        vocab_size=300, max_position_embeddings=64, rope_theta=5e5, tie_word_embeddings=False,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    narrow = narrowed_config(config)
    assert (narrow.hidden_size, narrow.num_hidden_layers, narrow.vocab_size) == (64, 2, NARROW_SIZES["vocab_size"])
    assert narrow.tie_word_embeddings is False and config.hidden_size == 96  # the rest kept; the original untouched
    model_file = load_model_file(f"hf:{tmp_path}")
    graph = annotate(capture(model_file, 2, True))
    real, checked = batch_coupling.coupling_reason, []
    monkeypatch.setattr(
        batch_coupling, "coupling_reason", lambda source, **k: checked.append(source) or real(source, **k)
    )
    monkeypatch.setattr(batch_coupling, "MAX_CHECK_BYTES", 0)
    assert batch_coupling.check_batch_coupling(model_file, graph).batch_coupling == ""
    assert [source.spec for source in checked] == [f"hf:{tmp_path} (narrowed)"]
