"""``modelfile.narrowed_config``: a transformers config at width 64 that still builds, and keeps every kind of layer.

Each case is an architecture whose own defaults build, and whose narrowed copy failed to build before the rule it
names (the library validates sizes derived from one another)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoshard.modelfile import NARROW_SIZES, narrowed_config  # noqa: E402

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
}


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
    assert max(widths) <= 4 * NARROW_SIZES["hidden_size"], (model_type, sorted(widths))


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


def test_a_single_kind_model_keeps_its_first_two_layers():
    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=96, num_attention_heads=6)
    narrow = narrowed_config(config)
    assert (narrow.num_hidden_layers, narrow.hidden_size, narrow.head_dim) == (2, 64, 16)
