"""Names in a captured graph: an op target's table key, the block a module path belongs to.

Plain string functions that the passes and the cost model both read a graph by::

    op_name("aten.add_.Tensor")  -> "add"      (in-place variants look up as their op)
    block_of("h.3.mlp.0")        -> "h.3"      (the outermost "<prefix>.<int>" prefix)
"""

from __future__ import annotations

import functools


@functools.cache  # a graph has a few hundred targets; the search reads them millions of times
def op_name(target: str) -> str:
    """The table key of a target: "aten.add_.Tensor" -> "add"; non-aten targets stay whole."""
    if not target.startswith("aten."):
        return target
    name = target.split(".")[1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def block_of(module_path: str) -> str | None:
    """The outermost "<prefix>.<int>" prefix of a module path: "h.3.mlp.0" -> "h.3"; None if none."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


# Random ops, by op_name: torch 2.13's ``nondeterministic_seeded`` tag (tests/test_randomness.py checks it
# against torch), ``random_`` which the tag leaves out, and the composite calls a captured graph keeps
# (feature dropout, attention, rrelu). ``runtime.randomness`` gives each a value every rank shares.
RANDOM_OPS = frozenset(
    {
        "bernoulli",
        "uniform",
        "rand",
        "rand_like",
        "normal",
        "normal_functional",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "random",
        "randperm",
        "multinomial",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "poisson",
        "binomial",
        "_standard_gamma",
        "dropout",
        "native_dropout",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "_fused_dropout",
        "rrelu",
        "rrelu_with_noise",
        "rrelu_with_noise_functional",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_attention_math_for_mps",
        "_scaled_dot_product_attention_math",
        "_flash_attention_forward",
        "_flash_attention_forward_no_dropout_inplace",
        "_efficient_attention_forward",
        "_cudnn_attention_forward",
        "_cudnn_attention_backward",
        "_triton_scaled_dot_attention",
        "_fused_sdp_choice",
        "_fill_mem_eff_dropout_mask",
        "_sample_dirichlet",
        "_nested_tensor_softmax_with_shape",
        "lstm",
        "gru",
        "rnn_tanh",
        "rnn_relu",
        "_cudnn_rnn",
        "miopen_rnn",
        "_lstm_mps",
        "_cudnn_init_dropout_state",
    }
)
# Ops random only when an argument turns their randomness on: op_name -> that argument (its schema name).
RANDOM_SWITCHES = {
    **dict.fromkeys(["dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"], "p"),
    **dict.fromkeys(["rrelu", "rrelu_with_noise", "rrelu_with_noise_functional"], "training"),
    **dict.fromkeys([op for op in RANDOM_OPS if "attention" in op], "dropout_p"),
    **dict.fromkeys(["_fused_sdp_choice", "_fill_mem_eff_dropout_mask"], "dropout_p"),
    **dict.fromkeys(
        ["lstm", "gru", "rnn_tanh", "rnn_relu", "_cudnn_rnn", "miopen_rnn", "_lstm_mps", "_cudnn_init_dropout_state"],
        "dropout",
    ),
}


def is_random(target: str, attrs: dict) -> bool:
    """Whether an op of a captured graph draws random numbers: a random op whose switch (``RANDOM_SWITCHES``)
    is on, and that is not told it is not training (``train=False``)."""
    name = op_name(target)
    if name not in RANDOM_OPS or attrs.get("train", attrs.get("training", True)) is False:
        return False
    switch = RANDOM_SWITCHES.get(name)
    return switch is None or bool(attrs.get(switch))
