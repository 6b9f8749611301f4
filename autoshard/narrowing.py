"""A transformers config narrowed to a width a CPU runs in a second, the same architecture's code on it
(``narrowed_config``): what ``hf:DIR``'s checks run on where the model is too large to run whole
(``modelfile.hf_causal_lm``'s ``narrowed()``), and what ``benchmarks/bench_hf_sweep.py`` plans and verifies every
causal LM of the library on."""

from __future__ import annotations

import contextlib
import copy

NARROW_LAYERS = 2
NARROW_HEAD_DIM = 16
NARROW_SIZES = {  # the standard names (a config's attribute_map routes them to its own), and encoder-decoder kin
    "hidden_size": 64,
    "num_hidden_layers": NARROW_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": NARROW_HEAD_DIM,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "mlp_only_intermediate_size": 128,  # the dense MLPs of the layers without experts (Kolibri 1.1's)
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4,  # ProphetNet's names for them
    "num_encoder_attention_heads": 4,
    "decoder_layers": NARROW_LAYERS,
    "encoder_layers": NARROW_LAYERS,
    "num_decoder_layers": NARROW_LAYERS,
    "num_encoder_layers": NARROW_LAYERS,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "d_head": NARROW_HEAD_DIM,  # XLNet's head width
    "qk_nope_head_dim": NARROW_HEAD_DIM // 2,  # latent attention: query/key width without and with rotary positions
    "qk_rope_head_dim": NARROW_HEAD_DIM // 2,
    "v_head_dim": NARROW_HEAD_DIM,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "linear_num_key_heads": 2,  # gated linear attention: value heads a multiple of key heads
    "linear_num_value_heads": 4,
    "linear_head_dim": NARROW_HEAD_DIM,  # linear attention's head width where one is shared (Bailing's hybrid)
    "linear_key_head_dim": NARROW_HEAD_DIM,
    "linear_value_head_dim": NARROW_HEAD_DIM,
    "feed_forward_size": 128,  # Reformer's and XLNet's feed-forward widths
    "d_inner": 128,
    "vocab_size_per_layer_input": 256,  # Gemma's per-layer token embeddings
    "hidden_size_per_layer_input": 16,
}
NARROW_TOP_K = 2  # experts per token: at most this, never more than the architecture's own
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")  # a model has experts where one is set
NARROW_AT_MOST = {  # counts lowered to at most these, never raised
    "n_group": 2,  # grouped routing (DeepSeek-V3): the 4 experts in 2 groups, chosen from the best 1
    "topk_group": 1,
    "first_k_dense_replace": 1,  # dense layers before the first expert layer: one, so one of two layers has experts
    "index_num_heads": 2,  # an attention indexer's heads (Kolibri 1.1's): at most the query heads of one key head
}
# Derived sizes a narrowed config keeps consistent: (a head count, its head width, the expansion factor, the inner
# width if the config names it) of Mamba-style mixers, whose heads x head width = the expansion x the hidden size.
MAMBA_HEADS = (
    ("num_heads", "head_dim", "expand", None),
    ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_d_ssm"),
    ("n_mamba_heads", "mamba_headdim", "mamba_expand", None),  # Zamba2
)
# Widths a config derives from its hidden size as a whole multiple of it (Zamba's attention input: the hidden state
# beside the embeddings, 2x; xLSTM's embedding width; OPT's word embedding projection): kept that multiple.
HIDDEN_MULTIPLES = (
    "attention_hidden_size",
    "embedding_dim",
    "word_embed_proj_dim",
    "ext_pw_out_channel",  # a conformer audio encoder's convolution widths (Phi-4-multimodal's)
    "depthwise_separable_out_channel",
    "nemo_conv_channels",
)
NARROW_PER_KIND = 2  # layers kept of each distinct kind of a per-layer list (a kind's second may tie to its first)
# Counts of layers that must sum to the model's layers (a looped model's prelude, recurrent and coda layers).
LAYER_PARTS = (("n_input_layers", "n_recurrent_layers", "n_output_layers"),)


def narrowed_config(config):
    """A copy of a transformers ``config`` small enough that a CPU runs the same architecture's code in a second:

    - the sizes of ``NARROW_SIZES`` where it has them;
    - the kind of key/value heads kept (multi-head stays multi-head, one head stays one, grouped stays grouped:
      ``_kv_heads_kept``);
    - sizes derived from others kept consistent: latent attention's widths, the rotary width's share of a head,
      the hidden-size multiples of ``HIDDEN_MULTIPLES``, Mamba heads (``MAMBA_HEADS``), Reformer's axial positions;
    - per-layer lists cut to layers that keep ``NARROW_PER_KIND`` of each kind (``_kept_layers``) and of each value
      of every per-layer list that says a kind (``_with_each_kind``), the lists of layer indices renumbered, and
      per-layer overrides following the layers kept, their widths scaled and a layer's sums of widths held
      (``LAYER_SUMS``);
    - experts per token at most ``NARROW_TOP_K`` (set where declared None beside experts), the counts of
      ``NARROW_AT_MOST`` lowered;
    - special token ids inside the vocabulary, ``use_cache`` off;

    every other setting as it was. A composite config has each of its parts narrowed (the text model's, and the
    vision or audio towers' where the library accepts it), and widths tied across its parts kept tied
    (``_retie_widths``)."""
    original = config
    config = _narrowed_parts(copy.deepcopy(config))
    _retie_widths(original, config)
    return config


def _narrowed_parts(config):
    """``narrowed_config``'s work on ``config`` (a copy) and each of its sub-configs, before widths are re-tied."""
    _narrow_sub_configs(config)
    if text_config(config) is not config:
        return config
    layers = _attribute(config, "num_hidden_layers")
    overrides = _without_per_layer_overrides(config)
    sums = {name for total, parts in LAYER_SUMS for name in (total, *parts)}
    before = {name: _attribute(config, name) for name in sums | {n for layer in overrides.values() for n in layer}}
    latent = _latent_head_rules(config)
    kv_heads = _kv_heads_kept(config)
    rotary_share = _rotary_share(config)
    multiples = _hidden_multiples(config)
    for name, value in NARROW_SIZES.items():
        _narrow(config, name, value)
    for name, multiple in multiples.items():
        _narrow(config, name, multiple * NARROW_SIZES["hidden_size"])
    if kv_heads is not None:
        _narrow(config, "num_key_value_heads", kv_heads)
    if rotary_share is not None:
        _narrow(config, "rotary_dim", _rotary_width(config, rotary_share))
    _narrow_latent_heads(config, latent)
    _narrow_unset_heads(config)
    top_k = _attribute(config, "num_experts_per_tok")
    if isinstance(top_k, int):
        _narrow(config, "num_experts_per_tok", min(top_k, NARROW_TOP_K))
    elif "num_experts_per_tok" in vars(config) and any(_attribute(config, n) for n in EXPERT_COUNTS):
        config.num_experts_per_tok = NARROW_TOP_K  # declared None beside experts (DeepSeek-V2's default)
    for name, most in NARROW_AT_MOST.items():
        if isinstance(count := _attribute(config, name), int) and count > most:
            _narrow(config, name, most)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids inside the narrowed vocabulary
        if isinstance(_attribute(config, name), int) and _attribute(config, name) >= NARROW_SIZES["vocab_size"]:
            setattr(config, name, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[name])
    kept = _cut_layers(config, layers) if isinstance(layers, int) else []
    if overrides:
        config.per_layer_config = _narrowed_overrides(config, overrides, before, kept)
    _narrow_mamba_heads(config)
    _narrow_axial_positions(config)
    config.use_cache = False
    return config


def _narrow_sub_configs(config) -> None:
    """Each sub-config of ``config`` narrowed in place: a composite's text model and towers, and the towers of a model
    whose text part is the config itself (Phi-4-multimodal's vision and audio encoders, 0.87 B parameters left
    whole beside a text model of width 64)."""
    for name, value in list(vars(config).items()):
        if _is_sub_config(value):  # a sub-config: the text model, a tower
            with contextlib.suppress(Exception):  # noqa: BLE001 (a tower the library will not narrow: as it is)
                setattr(config, name, _narrowed_parts(copy.deepcopy(value)))


def _is_sub_config(value) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _parts(config) -> list:
    """``config`` and its sub-configs, depth first, in attribute order."""
    return [config] + [p for v in vars(config).values() if _is_sub_config(v) for p in _parts(v)]


WIDTH_WORDS = ("dim", "size", "width", "channels")  # what the name of a width says


def _retie_widths(original, config) -> None:
    """Widths a composite config ties across its parts by equality, kept equal (in place). A tower's adapter maps its
    own width to the text model's (Dots3Note: the vision adapter's ``adapter_in_dim`` is the tower's ``hidden_size``,
    its ``adapter_out_dim`` the text model's), and the config's validators refuse any other value; narrowing each
    part's ``hidden_size`` left those widths as they were. Only where a part fails its own validation: each whole-number
    width (named with ``WIDTH_WORDS``) the narrowing left unchanged and that equals a part's original ``hidden_size``
    takes that part's narrowed one, the text model's first where two parts had the same."""
    before, after = _parts(original), _parts(config)
    if len(before) != len(after) or all(_valid(part) for part in after):
        return
    text = text_config(config)
    text_first = sorted(zip(before, after), key=lambda pair: pair[1] is not text)
    widths: dict[int, int] = {}
    for old, new in text_first:
        old_width, new_width = _attribute(old, "hidden_size"), _attribute(new, "hidden_size")
        if isinstance(old_width, int) and isinstance(new_width, int) and old_width != new_width:
            widths.setdefault(old_width, new_width)
    for old, new in zip(before, after):
        for name, value in vars(old).items():
            tied = isinstance(value, int) and not isinstance(value, bool) and value in widths
            if tied and any(word in name for word in WIDTH_WORDS) and vars(new).get(name) == value:
                with contextlib.suppress(Exception):  # noqa: BLE001 (a width the config will not take: as it was)
                    setattr(new, name, widths[value])


def _valid(config) -> bool:
    """Whether ``config`` passes its own validators (a config without them: True)."""
    validate = getattr(config, "validate", None)
    if not callable(validate):
        return True
    try:
        validate()
    except Exception:  # noqa: BLE001 (any validator's refusal)
        return False
    return True


def text_config(config):
    """The config of a composite model's text decoder (``get_text_config``), or ``config`` itself."""
    getter = getattr(config, "get_text_config", None)
    try:
        return getter() if callable(getter) else config
    except Exception:  # noqa: BLE001 (a config class without a text part may refuse)
        return config


def _attribute(config, name: str):
    """``config.name``, or None where the config has none or refuses to say (a per-layer attribute of a config
    whose layers differ raises rather than answer for all of them)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 (transformers' AmbiguousGlobalPerLayerAttributeError and the like)
        return None


def _narrow(config, name: str, value) -> None:
    """``config.name = value`` where the config holds a value there (a per-layer list: ``value`` for each layer); a
    derived or unsettable attribute kept."""
    old = _attribute(config, name)
    if old is not None:
        with contextlib.suppress(AttributeError, NotImplementedError):  # Falcon's head_dim; XLNet's positions
            setattr(config, name, [value] * len(old) if isinstance(old, list) else value)


def _kv_heads_kept(config) -> int | None:
    """The narrowed key/value head count where the config's own is not grouped query attention's: as many as the
    narrowed query heads where it has as many as its query heads (multi-head attention; latent attention expands
    its keys to every head and then repeats them by heads / key/value heads, so fewer would break its shapes), 1
    where it has 1 (multi-query); None (``NARROW_SIZES``' grouped count) otherwise."""
    heads, kv_heads = _attribute(config, "num_attention_heads"), _attribute(config, "num_key_value_heads")
    if not (isinstance(heads, int) and isinstance(kv_heads, int)):
        return None
    if kv_heads == heads:
        return NARROW_SIZES["num_attention_heads"]
    return 1 if kv_heads == 1 else None


def _narrow_unset_heads(config) -> None:
    """A head width or key/value head count the config declares but leaves None, which some architectures read
    as it is: the narrowed width's own (64 / 4 heads = 16; key/value heads = heads)."""
    fields = vars(config)
    if "head_dim" in fields and fields["head_dim"] is None:
        config.head_dim = NARROW_SIZES["hidden_size"] // NARROW_SIZES["num_attention_heads"]
    if "num_key_value_heads" in fields and fields["num_key_value_heads"] is None:
        config.num_key_value_heads = _attribute(config, "num_attention_heads")


def _kept_layers(kinds: list, count: int) -> list[int]:
    """Which of the layers to keep: the first ``NARROW_PER_KIND`` of each distinct kind in ``kinds`` (a per-layer
    list of hashable values), then the earliest others, ``count`` at least, in the model's order: every kind of
    layer the model has is in the narrowed one (a check on it covers each kind's code)."""
    of_kind: dict = {}
    for index, kind in enumerate(kinds):
        with contextlib.suppress(TypeError):  # an unhashable entry: the layers by position alone
            if len(of_kind.setdefault(kind, [])) < NARROW_PER_KIND:
                of_kind[kind].append(index)
    kept = {index for indices in of_kind.values() for index in indices} if len(of_kind) > 1 else set()
    for index in range(len(kinds)):
        if len(kept) >= count:
            break
        kept.add(index)
    return sorted(kept)


KIND_VALUES_AT_MOST = 4  # a per-layer list of at most this many distinct values says a kind of layer (not a width)


def _with_each_kind(kept: list[int], per_layer: list[list]) -> list[int]:
    """``kept`` and, for each value of each of the ``per_layer`` lists that say a kind (more than one distinct value,
    at most ``KIND_VALUES_AT_MOST``, hashable: ``mlp_layer_types``' dense and sparse, SmolLM3's RoPE flags) held by
    fewer than ``NARROW_PER_KIND`` kept layers, the earliest other layers of that value up to that many: a check on the
    narrowed model runs each kind's code, and not only ``layer_types``' (DeepSeek-V3.2's first 2 layers are dense,
    and its experts were not in the narrowed model)."""
    kept = set(kept)
    for value in per_layer:
        with contextlib.suppress(TypeError):  # an unhashable entry: not a kind
            if not 1 < len(set(value)) <= KIND_VALUES_AT_MOST:
                continue
            for kind in dict.fromkeys(value):
                of_kind = [index for index, entry in enumerate(value) if entry == kind]
                missing = NARROW_PER_KIND - sum(index in kept for index in of_kind)
                kept.update([index for index in of_kind if index not in kept][: max(missing, 0)])
    return sorted(kept)


def _cut_layers(config, layers: int) -> list[int]:
    """Per-layer lists (``layer_types`` and the like, ``layers`` long) cut to the same kept layers (a kind of layer
    among the last ones that share earlier layers' keys and values, ``num_kv_shared_layers``, a kind of its own; the
    layers a kept layer reads from, ``_source_lists``, kept too), lists of layer indices (``_layer_id_lists``) and
    the per-layer lists of the layer each reads from renumbered to them, the layer count set to match, and counts of
    layer parts that must sum to it (``LAYER_PARTS``) one each, the middle part taking any more. Returns the kept
    layers' indices."""
    lists = {name: value for name, value in vars(config).items() if isinstance(value, list) and len(value) == layers}
    parts = next(
        (p for p in LAYER_PARTS if sum(c if isinstance(c := _attribute(config, n), int) else -1 for n in p) == layers),
        (),
    )
    ids = _layer_id_lists(config, layers, lists)  # Llama 4's moe_layers, every layer's index: renumbered, not cut
    lists = {name: value for name, value in lists.items() if name not in ids}
    kinds = lists.get("layer_types") or next(iter(lists.values()), [None] * layers)
    shared = _attribute(config, "num_kv_shared_layers")  # the last layers reuse earlier layers' keys and values
    shared = min(shared, layers) if isinstance(shared, int) and shared > 0 else 0
    kinds = [(kind, index >= layers - shared) for index, kind in enumerate(kinds)] if shared else kinds
    count = max(NARROW_LAYERS, len(parts))
    sources = _source_lists(lists)
    if layers > count:
        kept = _kept_layers(kinds, count)
        kept = _with_each_kind(kept, [value for name, value in lists.items() if name not in sources])
    else:
        kept = list(range(layers))
    kept = sorted({*kept, *(value[i] for value in sources.values() for i in kept)})
    for name, value in lists.items():
        setattr(config, name, [kept.index(value[i]) if name in sources else value[i] for i in kept])
    for name, value in ids.items():  # Zamba2's hybrid_layer_ids, Kolibri 1.1's index_layers: renumbered
        setattr(config, name, [kept.index(i) for i in value if i in kept])
    if len(kept) != _attribute(config, "num_hidden_layers"):
        _narrow(config, "num_hidden_layers", len(kept))
    if shared:
        config.num_kv_shared_layers = sum(index >= layers - shared for index in kept)
    for index, name in enumerate(parts):
        setattr(config, name, 1 + (len(kept) - len(parts) if index == len(parts) // 2 else 0))
    return kept


def _without_per_layer_overrides(config) -> dict[int, dict]:
    """A heterogeneous config's per-layer overrides (transformers' ``per_layer_config``: Gemma 4's global-attention
    layers' wider heads), taken off it so that its global attributes read and narrow as any config's; {} for
    another config."""
    spec = vars(config).get("_heterogeneity_spec")
    if spec is None:
        return {}
    overrides = copy.deepcopy(spec.per_layer_overrides)
    config.per_layer_config = None
    return overrides


def _narrowed_overrides(config, overrides: dict[int, dict], before: dict, kept: list[int]) -> dict[int, dict]:
    """``overrides`` of the ``kept`` layers (all where none were cut), renumbered to them, each whole-number override
    of an attribute the narrowing changed scaled as its global value was (Gemma 4: heads of 512 beside 256 become 32
    beside 16), every other override as it was; a layer's sums kept (``_keep_layer_sums``)."""
    narrowed = {}
    for new, old in enumerate(kept or sorted(overrides)):
        layer = {}
        for name, value in overrides.get(old, {}).items():
            was, now = before.get(name), _attribute(config, name)
            if _whole(value) and _whole(was) and _whole(now) and was and now != was:
                value = max(1, round(value * now / was))
            layer[name] = value
        _keep_layer_sums(config, layer, overrides.get(old, {}), before)
        if layer:
            narrowed[new if kept else old] = layer
    return narrowed


# A layer's width that was the sum of others (Dots3Note's sliding-window layers: head width = query/key width without
# + with rotary positions, which its validator requires), and the parts; the first part takes the difference
LAYER_SUMS = (("head_dim", ("qk_nope_head_dim", "qk_rope_head_dim")),)


def _keep_layer_sums(config, layer: dict, original: dict, before: dict) -> None:
    """Each sum of ``LAYER_SUMS`` the layer's original widths held (its overrides, else the global values ``before``
    narrowing), held again in ``layer`` (in place): its first part set to the narrowed total less the other parts
    (the layer's overrides, else the narrowed global values)."""
    for total, parts in LAYER_SUMS:
        was = [original.get(name, before.get(name)) for name in (total, *parts)]
        if not all(_whole(w) for w in was) or was[0] != sum(was[1:]):
            continue
        now = [layer.get(name, _attribute(config, name)) for name in (total, *parts[1:])]
        if all(_whole(n) for n in now) and now[0] - sum(now[1:]) >= 1:
            layer[parts[0]] = now[0] - sum(now[1:])


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _layer_id_lists(config, layers: int, per_layer: dict) -> dict[str, list[int]]:
    """The config's lists of layer indices: a name ending in ``layer_ids`` or ``_layers`` (Qwen-MoE's and Kolibri
    1.1's ``mlp_only_layers``), every entry a layer of ``layers``; one as long as the ``per_layer`` lists only where
    its entries rise strictly (Llama 4's ``moe_layers`` naming every layer; SmolLM3's ``no_rope_layers``, as long,
    holds a flag per layer)."""
    return {
        name: value
        for name, value in vars(config).items()
        if name.endswith(("layer_ids", "_layers"))
        and isinstance(value, list)
        and all(_whole(i) for i in value)
        and all(0 <= i < layers for i in value)
        and (name not in per_layer or all(a < b for a, b in zip(value, value[1:])))
    }


def _source_lists(per_layer: dict[str, list]) -> dict[str, list[int]]:
    """The per-layer lists that name, for each layer, the earlier layer it reads from (a name with ``source``, layer
    ``i``'s entry a layer ``j <= i``, itself where it reads its own: Kolibri 1.1's ``kv_source_layers``)."""
    return {
        name: value
        for name, value in per_layer.items()
        if "source" in name and all(_whole(j) and 0 <= j <= i for i, j in enumerate(value))
    }


def _narrow_axial_positions(config) -> None:
    """Axial position embeddings (Reformer): their two widths sum to the hidden size, their two lengths multiply to
    the narrowed positions (128 = 8 x 16)."""
    if isinstance(_attribute(config, "axial_pos_embds_dim"), (list, tuple)):
        half, kind = NARROW_SIZES["hidden_size"] // 2, type(config.axial_pos_shape)  # a tuple: the model adds tuples
        config.axial_pos_embds_dim = kind([half, half])
        config.axial_pos_shape = kind([8, NARROW_SIZES["max_position_embeddings"] // 8])


def _latent_head_rules(config) -> tuple[bool, bool]:
    """Which of latent attention's derived widths the config's ``__init__`` set from the others (DeepSeek-V2/V3 and
    their kin): (query/key width = without + with rotary positions, the head width = the rotary part's)."""
    nope, rope = _attribute(config, "qk_nope_head_dim"), _attribute(config, "qk_rope_head_dim")
    if not (isinstance(nope, int) and isinstance(rope, int)):
        return False, False
    return _attribute(config, "qk_head_dim") == nope + rope, _attribute(config, "head_dim") == rope


def _hidden_multiples(config) -> dict[str, int]:
    """Each width of ``HIDDEN_MULTIPLES`` the config has as a whole multiple of its hidden size: that multiple."""
    hidden = _attribute(config, "hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        return {}
    widths = {name: _attribute(config, name) for name in HIDDEN_MULTIPLES}
    return {name: w // hidden for name, w in widths.items() if isinstance(w, int) and w >= hidden and w % hidden == 0}


def _head_width(config) -> int | None:
    """A head's width: ``head_dim`` where the config sets one, else hidden size / heads."""
    width = _attribute(config, "head_dim")
    if isinstance(width, int):
        return width
    hidden, heads = _attribute(config, "hidden_size"), _attribute(config, "num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _rotary_share(config) -> float | None:
    """The share of a head's width that rotary positions take where the config gives it as a width (``rotary_dim``:
    CodeGen, GPT-J, MiniMax), or None."""
    rotary, width = _attribute(config, "rotary_dim"), _head_width(config)
    return rotary / width if isinstance(rotary, int) and width else None


def _rotary_width(config, share: float) -> int:
    """The narrowed ``rotary_dim``: the same share of the narrowed head width, even (rotary pairs), at least 2."""
    return max(2, 2 * round(share * (_head_width(config) or NARROW_HEAD_DIM) / 2))


def _narrow_latent_heads(config, rules: tuple[bool, bool]) -> None:
    """Latent attention's derived widths set again from the narrowed ones (``_latent_head_rules``): the rotary
    embedding is sized by ``head_dim``, the query projection by ``qk_head_dim``."""
    total, rotary = rules
    nope, rope = _attribute(config, "qk_nope_head_dim"), _attribute(config, "qk_rope_head_dim")
    with contextlib.suppress(AttributeError):
        if total:
            config.qk_head_dim = nope + rope
        if rotary:
            config.head_dim = rope


def _narrow_mamba_heads(config) -> None:
    """Mamba-style mixers: heads x head width = expansion x hidden size, with the narrowed head width (16)."""
    hidden = _attribute(config, "hidden_size")
    for heads, width, expand, inner in MAMBA_HEADS:
        factor = _attribute(config, expand)
        if isinstance(factor, (int, float)) and _attribute(config, heads) and _attribute(config, width):
            count = max(1, int(factor * hidden) // NARROW_HEAD_DIM)
            with contextlib.suppress(AttributeError):
                setattr(config, width, NARROW_HEAD_DIM)
                setattr(config, heads, count)
                if inner and _attribute(config, inner):
                    setattr(config, inner, count * NARROW_HEAD_DIM)
