"""``narrowing.narrowed_config``: a transformers config at width 64 that still builds, and keeps every kind of layer.

Each case is an architecture whose own defaults build, and whose narrowed copy failed to build before the rule it
names (the library validates sizes derived from one another)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoshard.narrowing import NARROW_HEAD_DIM, NARROW_SIZES, narrowed_config  # noqa: E402

CASES = {  # model type -> the rule its narrowed config needs
    "olmo_hybrid": "every kind of layer kept (its first layers are all linear attention)",
    "mamba2": "Mamba heads x head width = expansion x hidden",
    "falcon_h1": "Mamba heads and their inner width",
    "dory": "prelude, recurrent and coda layer counts summing to the layers",
    "zaya": "experts per token never above the architecture's own",
    "xlnet": "its head width d_head, and positions it cannot set",
    "plbart": "an encoder-decoder family's decoder heads",
    "hunyuan_v1_dense": "a head width declared None",
    "nemotron": "key/value heads declared None",
    "reformer": "axial position embeddings",
    "gemma3n_text": "per-layer widths, and the last layers sharing earlier layers' keys and values",
    "gemma3": "a composite config: its text model and its vision tower",
    "phi4_multimodal": "vision and audio towers beside a text model that is the config itself, the audio "
    "encoder's convolution widths with them",
    "kolibri1_1": "lists of layer indices renumbered, the layer each reads keys and values from kept, indexer heads",
}
# the widest weight as a multiple of the narrowed width where it is not 4: Phi-4-multimodal's audio subsampling
# flattens its 64 channels over 10 of its 80 mel bins (a width of the input, not of the model); 10 240 before its
# towers were narrowed
WIDEST = {"phi4_multimodal": 10}


def _narrowed(model_type: str):
    config = narrowed_config(transformers.CONFIG_MAPPING[model_type]())
    if getattr(config, "is_decoder", None) is False:
        config.is_decoder = True
    return config


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_a_narrowed_config_builds_at_the_narrowed_width(model_type, tmp_path):
    config = _narrowed(model_type)
    config.save_pretrained(tmp_path)  # the library's own validation of the sizes
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    widths = {p.shape[-1] for p in model.parameters() if p.dim() == 2}
    assert max(widths) <= WIDEST.get(model_type, 4) * NARROW_SIZES["hidden_size"], (model_type, sorted(widths))


def test_a_narrowed_config_keeps_each_kind_of_layer_and_their_order():
    """OLMo-Hybrid: three linear-attention layers, then a full one, repeated; two of each kind kept, in order."""
    config = transformers.CONFIG_MAPPING["olmo_hybrid"]()
    kinds = list(config.layer_types)
    narrow = narrowed_config(config)
    assert sorted(set(narrow.layer_types)) == sorted(set(kinds))
    assert narrow.num_hidden_layers == len(narrow.layer_types) == 2 * len(set(kinds))
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"][:2]
    linear = [i for i, kind in enumerate(kinds) if kind != "full_attention"][:2]
    assert narrow.layer_types == [kinds[i] for i in sorted(full + linear)]
    assert config.num_hidden_layers == len(kinds)  # the original untouched


def test_a_composite_config_is_narrowed_in_each_part_and_plans_from_its_text_part(tmp_path):
    """Gemma 3's config holds a text config and a vision tower's: both narrowed, so its causal LM is small; ``hf:DIR``
    reads the vocabulary from the text part (the composite has none of its own)."""
    from autoshard.modelfile import load_model_file
    from autoshard.narrowing import text_config

    config = _narrowed("gemma3")
    assert text_config(config) is not config and text_config(config).hidden_size == NARROW_SIZES["hidden_size"]
    assert config.vision_config.hidden_size == NARROW_SIZES["hidden_size"]
    config.save_pretrained(tmp_path)
    model_file = load_model_file(f"hf:{tmp_path}")
    (tokens,), targets = model_file.module.example_batch(2, seq_len=8)
    assert tokens.shape == targets.shape == (2, 8) and int(tokens.max()) < NARROW_SIZES["vocab_size"]
    with torch.device("meta"):
        model = model_file.module.build()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_widths_tied_across_a_composite_configs_parts_stay_tied(tmp_path):
    """Dots3Note's towers map their width to the text model's through adapters whose widths its validators require
    equal to those hidden sizes: narrowed, each adapter takes the narrowed widths, so the config saves (its
    validators run) and builds. Before, the adapters kept 1536 and 5120 and save_pretrained refused the config."""
    import transformers

    original = transformers.Dots3NoteConfig()
    config = narrowed_config(original)
    width = NARROW_SIZES["hidden_size"]
    vision, audio = config.vision_config, config.audio_config
    assert config.text_config.hidden_size == vision.hidden_size == audio.hidden_size == width
    assert vision.adapter_in_dim == vision.adapter_out_dim == audio.adapter_input_size == audio.adapter_out_dim == width
    assert original.vision_config.adapter_out_dim == original.text_config.hidden_size != width  # the original untouched
    config.architectures = ["Dots3NoteForCausalLM"]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_a_layers_head_width_stays_the_sum_of_its_parts_and_the_folder_reads_back(tmp_path):
    """Dots3Note's sliding-window layers override the query/key width without rotary positions (192 beside the
    global 128) and take head width = that + the rotary part (256 = 192 + 64), which its validator requires when the
    folder is read back: narrowed, the sum holds again (16 = 8 + 8); before, the override scaled alone to 12 and
    ``from_pretrained`` refused the folder."""
    import transformers

    from autoshard.narrowing import _keep_layer_sums

    config = narrowed_config(transformers.Dots3NoteConfig())
    config.architectures = ["Dots3NoteForCausalLM"]
    config.save_pretrained(tmp_path)
    read = transformers.AutoConfig.from_pretrained(tmp_path)
    sliding = read.text_config.per_layer_config[read.text_config.layer_types.index("sliding_attention")]
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim == NARROW_HEAD_DIM
    # the rule alone: only a sum the original layer held is kept
    held, not_held = {"qk_nope_head_dim": 12}, {"qk_nope_head_dim": 12}
    narrow = transformers.PretrainedConfig(head_dim=16, qk_nope_head_dim=8, qk_rope_head_dim=8)
    _keep_layer_sums(narrow, held, {"qk_nope_head_dim": 192}, {"head_dim": 256, "qk_rope_head_dim": 64})
    _keep_layer_sums(narrow, not_held, {"qk_nope_head_dim": 128}, {"head_dim": 256, "qk_rope_head_dim": 64})
    assert held == {"qk_nope_head_dim": 8} and not_held == {"qk_nope_head_dim": 12}


def test_a_valid_narrowed_config_keeps_widths_that_only_happen_to_be_equal():
    """Widths are re-tied only where a part fails its own validation: a Gemma 3 whose vision tower's image size
    happens to equal the text model's hidden size is valid narrowed, and keeps that image size."""
    import transformers

    text_width = transformers.Gemma3TextConfig().hidden_size
    original = transformers.Gemma3Config(vision_config={"image_size": text_width})
    assert original.text_config.hidden_size == original.vision_config.image_size  # a width equal by chance
    config = narrowed_config(original)
    assert config.text_config.hidden_size == NARROW_SIZES["hidden_size"]
    assert config.vision_config.image_size == text_width


def test_kv_sharing_layers_stay_last_and_counted():
    """Gemma 3n: its last layers reuse earlier layers' keys and values; the narrowed model keeps two of each kind
    among them too, last, and says how many it kept."""
    config = transformers.CONFIG_MAPPING["gemma3n_text"]()
    narrow = narrowed_config(config)
    shared = narrow.num_kv_shared_layers
    assert 0 < shared < narrow.num_hidden_layers
    assert set(narrow.layer_types[-shared:]) == set(narrow.layer_types[:-shared]) == set(config.layer_types)
    assert narrow.intermediate_size == [NARROW_SIZES["intermediate_size"]] * narrow.num_hidden_layers


def test_lists_of_layer_indices_follow_the_kept_layers():
    """Kolibri 1.1: ``index_layers`` and ``mlp_only_layers`` list layers, ``kv_source_layers`` names per layer the
    layer whose keys and values it reads; narrowed, each names the same layers by their new numbers, and a kept layer's
    source is kept. Before, Kolibri 1.1's lists kept the old numbers and its narrowed config failed the library's validation."""
    config = transformers.CONFIG_MAPPING["kolibri1_1"]()
    narrow = narrowed_config(config)
    indexed = [i for i, kind in enumerate(config.layer_types) if kind == "indexed_attention"][:2]
    kept = sorted({0, 1, *indexed, *(config.kv_source_layers[i] for i in indexed)})
    assert narrow.layer_types == [config.layer_types[i] for i in kept]
    assert narrow.index_layers == [kept.index(i) for i in config.index_layers if i in kept]
    assert narrow.kv_source_layers == [kept.index(config.kv_source_layers[i]) for i in kept]
    assert narrow.mlp_only_layers == [kept.index(i) for i in config.mlp_only_layers if i in kept]
    narrow.validate_architecture()


@pytest.mark.parametrize(
    ("model_type", "kinds"),
    [("deepseek_v32", "mlp_layer_types"), ("hy_v4", "indexer_types"), ("smollm3", "no_rope_layers")],
)
def test_each_kind_of_every_per_layer_list_is_kept_twice(model_type, kinds):
    """A kind of layer said by a per-layer list other than ``layer_types`` (DeepSeek-V3.2's dense and sparse MLPs,
    Hy v4's full and shared indexers, SmolLM3's layers with and without RoPE) is in the narrowed model twice, each
    at its place: before, the narrowing kept the first 2 layers, so DeepSeek-V3.2's narrowed model had no experts
    and SmolLM3's no layer without RoPE, and a check on them ran neither's code."""
    config = transformers.CONFIG_MAPPING[model_type]()
    narrow = narrowed_config(config)
    original, cut = getattr(config, kinds), getattr(narrow, kinds)
    assert all(cut.count(kind) == min(2, original.count(kind)) for kind in set(original)), (original, cut)
    assert narrow.num_hidden_layers == len(cut) == len(narrow.layer_types)
    assert [original.index(kind) for kind in dict.fromkeys(cut)] == sorted(original.index(k) for k in set(original))


def test_a_list_of_every_layers_index_is_renumbered_not_cut():
    """Llama 4's ``moe_layers`` names every layer (one expert layer per layer by default): as long as the per-layer
    lists, it is still a list of indices, so the narrowed model's layers are all expert layers. Cut as a per-layer
    list it kept old numbers ([0, 1, 3, 7] of 4 layers), and the third narrowed layer lost its experts."""
    config = transformers.CONFIG_MAPPING["llama4_text"]()
    narrow = narrowed_config(config)
    assert config.moe_layers == list(range(config.num_hidden_layers))
    assert narrow.moe_layers == list(range(narrow.num_hidden_layers))
    assert narrow.num_hidden_layers == len(narrow.no_rope_layers) > 2


def test_a_single_kind_model_keeps_its_first_two_layers():
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=96, num_attention_heads=6)
    narrow = narrowed_config(config)
    assert (narrow.num_hidden_layers, narrow.hidden_size, narrow.head_dim) == (2, 64, 16)


def test_an_architecture_without_sdpa_builds_with_its_own_attention(tmp_path):
    """hf:DIR asks for SDPA first; an architecture that refuses it (Bloom: ALiBi through its own attention) is built
    again with its own. transformers writes the refused implementation into the config it was given, so the second
    build takes a copy the refusal did not touch: built from the same one, it refused again and hf:DIR could not
    build Bloom at all."""
    from autoshard.modelfile import hf_causal_lm

    transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=256).save_pretrained(tmp_path)
    with torch.device("meta"):
        model = hf_causal_lm(f"hf:{tmp_path}").module.build()
    assert type(model).__name__ == "BloomForCausalLM" and model.config._attn_implementation == "eager"


RUN_CASES = {  # model type -> the rule its narrowed config needs to run a forward (building on meta is not enough)
    "deepseek_v3": "latent attention's head_dim and qk_head_dim from the narrowed rotary and non-rotary widths; "
    "routing groups and dense layers lowered, so the second layer has experts",
    "deepseek_v2": "experts per token declared None beside experts",
    "bailing_hybrid": "linear attention's shared head width; 4 experts in at most 2 routing groups",
}


@pytest.mark.parametrize("model_type", sorted(RUN_CASES))
def test_a_narrowed_config_runs_forward_and_keeps_its_experts(model_type):
    config = _narrowed(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    logits = model(torch.randint(0, NARROW_SIZES["vocab_size"], (2, 16))).logits
    assert logits.shape == (2, 16, NARROW_SIZES["vocab_size"]) and torch.isfinite(logits).all()
    experts = [name for name, _ in model.named_modules() if name.endswith(".experts")]
    assert experts, f"{model_type}: no expert layer left in {config.num_hidden_layers} layers"


@pytest.mark.parametrize(
    "model_type, kind", [("deepseek_v3", "multi-head"), ("gpt_bigcode", "multi-query"), ("mistral", "grouped")]
)
def test_a_narrowed_config_keeps_its_kind_of_key_value_heads(model_type, kind):
    """Multi-head attention stays multi-head (as many key/value heads as heads), multi-query one key/value head, and
    grouped attention gets 2 per 4 heads. Latent attention (DeepSeek) expands its keys to every head and repeats them
    by heads / key/value heads: narrowed to 2 key/value heads it made 8 key heads for 4 query heads, which
    torch.export refused at attention (the masked path; unmasked, SDPA's grouped kernel hid the mismatch)."""
    config = _narrowed(model_type)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    assert kv_heads == {"multi-head": heads, "multi-query": 1, "grouped": NARROW_SIZES["num_key_value_heads"]}[kind]
    if model_type == "deepseek_v3":
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        tokens = torch.randint(0, NARROW_SIZES["vocab_size"], (2, 16))
        mask = torch.ones_like(tokens).tril(-1).flip(1)  # left padding: a mask the attention must apply
        assert model(tokens, attention_mask=mask).logits.shape == (2, 16, NARROW_SIZES["vocab_size"])


@pytest.mark.parametrize("model_type", ["codegen", "gptj"])
def test_a_rotary_width_is_narrowed_with_the_head_width(model_type):
    """CodeGen and GPT-J give rotary positions a width of their own (``rotary_dim`` 64 of 256 per head): left at 64
    beside the narrowed heads of 16 it broke the forward's shapes (torch.export refused CodeGen at its rotary
    embedding). It keeps its share of the head: 4 of 16."""
    config = _narrowed(model_type)
    assert config.rotary_dim == 4 and config.hidden_size // config.num_attention_heads == 16
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    logits = model(torch.randint(0, NARROW_SIZES["vocab_size"], (2, 16))).logits
    assert logits.shape == (2, 16, NARROW_SIZES["vocab_size"]) and torch.isfinite(logits).all()


FORWARD_CASES = {  # model type -> the rule its narrowed config needs to run a forward
    "zamba": "the attention's input width, twice the hidden size (the hidden state beside the embeddings)",
    "zamba2": "its Mamba heads x their width = expansion x hidden, and its hybrid layers' indices renumbered",
    "xlstm": "its embedding width, the hidden size's",
    "reformer": "axial position shapes kept tuples (the model adds them to tuples)",
}


@pytest.mark.parametrize("model_type", sorted(FORWARD_CASES))
def test_a_narrowed_config_runs_a_forward(model_type):
    """Each failed in its first forward before its rule (a width derived from the hidden size left at the full
    model's, layer indices past the kept layers, a list where the model adds a tuple), at 128 tokens, the sweep's."""
    config = _narrowed(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(3, NARROW_SIZES["vocab_size"], (2, NARROW_SIZES["max_position_embeddings"]))
    logits = model(tokens).logits
    assert logits.shape == (*tokens.shape, NARROW_SIZES["vocab_size"]) and torch.isfinite(logits).all()


def test_a_heterogeneous_configs_per_layer_overrides_follow_the_kept_layers(tmp_path):
    """Gemma 4 gives its global-attention layers (5, 11, ... of 30) heads of 512 beside 256 through transformers'
    per-layer config. Cut to its first two layers of each kind, the overrides kept layers 5 and 11 past the 4 kept
    and the library refused to read the folder back; they now follow the kept layers (2 and 3), their widths scaled as
    the global one was (32 beside 16)."""
    config = _narrowed("gemma4_text")
    config.save_pretrained(tmp_path)
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    types = loaded.layer_types
    overrides = loaded.to_dict()["per_layer_config"]
    assert {int(i) for i in overrides} == {i for i, kind in enumerate(types) if kind == "full_attention"}
    assert all(layer == {"head_dim": 32} for layer in overrides.values())
    model = transformers.AutoModelForCausalLM.from_config(loaded)
    assert model(torch.randint(3, NARROW_SIZES["vocab_size"], (2, 16))).logits.shape[-1] == NARROW_SIZES["vocab_size"]
