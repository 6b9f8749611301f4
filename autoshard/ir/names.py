"""Names in a captured graph: an op target's table key, the block a module path belongs to.

Plain string functions that the passes and the cost model both read a graph by::

    op_name("aten.add_.Tensor")  -> "add"      (in-place variants look up as their op)
    block_of("h.3.mlp.0")        -> "h.3"      (the outermost "<prefix>.<int>" prefix)

and the op lists they share: ``VIEW_OPS`` (an output that is a view of input 0), ``NO_OP_OPS`` (checks and
symbolic sizes: compute nothing), ``CAST_OPS`` (copies, or views where they change nothing).
"""

from __future__ import annotations

import functools


@functools.cache  # a graph has a few hundred targets; the search reads them millions of times
def op_name(target: str) -> str:
    """The table key of a target: "aten.add_.Tensor" -> "add"; non-aten targets stay whole."""
    if not target.startswith("aten."):
        return target
    name = target.split(".")[1]
    return name[:-1] if is_in_place(target) else name


def is_in_place(target: str) -> bool:
    """Whether an aten target writes into its first input: "aten.add_.Tensor", "aten.copy_.default" (ATen's
    trailing underscore); not "aten.__and__.Tensor"."""
    if not target.startswith("aten."):
        return False
    name = target.split(".")[1]
    return name.endswith("_") and not name.endswith("__")


def block_of(module_path: str) -> str | None:
    """The outermost "<prefix>.<int>" prefix of a module path: "h.3.mlp.0" -> "h.3"; None if none."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


# Ops whose output is a view or alias of input 0, by op_name: no FLOPs, no bytes, no storage of their own
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "view_as",
        "reshape_as",
        "transpose",
        "t",
        "permute",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "alias",
        "detach",
        "as_strided",
        "unflatten",
        "flatten",
        "movedim",
        "moveaxis",
        "swapaxes",
        "swapdims",
        "diagonal",
        "view_as_real",
        "view_as_complex",
        "real",
        "imag",
        "lift_fresh",
        "numpy_T",
        "mT",
        "adjoint",
        "operator.getitem",
    }
)
# Ops that compute nothing a step pays for: checks and symbolic sizes
NO_OP_OPS = frozenset(
    {
        "_assert_tensor_metadata",
        "_assert_scalar",
        "_assert_async",
        "sym_size",
        "sym_numel",
        "sym_stride",
        "sym_storage_offset",
        "sym_constrain_range",
        "sym_constrain_range_for_size",
    }
)
# Casts and copies: a view where they change neither shape nor dtype (and the dtype they run in, ``cost.casts``)
CAST_OPS = frozenset({"to", "_to_copy", "type_as", "clone", "contiguous"})


# Batch normalisation, by op_name: normalises over the samples of each micro-batch (``has_batch_norm``).
BATCH_NORM_OPS = frozenset(
    "batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
    "_native_batch_norm_legit_no_training cudnn_batch_norm miopen_batch_norm".split()
)


def has_batch_norm(targets) -> bool:
    """Whether any of the captured ops' ``targets`` ("aten.<op>.<overload>") runs a batch normalisation
    (BatchNorm*, SyncBatchNorm, functional ``batch_norm``)."""
    return any(t.split(".")[1] in BATCH_NORM_OPS for t in targets if t.startswith("aten."))


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


def home_index(name: str, read_by: list[set[str]]) -> int:
    """Where state named ``name`` that nothing reads lives, among places each reading the names in ``read_by``
    (pipeline stages, cost units): the first that reads state of its nearest enclosing module (``a.b.w``: a name
    under ``a.b.``, else under ``a.``), else the first. The runtime's stages and the cost model's units use the
    same rule, so the bytes are priced where the program keeps them."""
    scope = name
    while "." in scope:
        scope = scope.rpartition(".")[0]
        readers = [i for i, names in enumerate(read_by) if any(n.startswith(scope + ".") for n in names)]
        if readers:
            return readers[0]
    return 0
