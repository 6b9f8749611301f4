"""Build the model the plan was made for, and check that it is that model."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

import torch
import torch.nn as nn

from autoshard.errors import AutoshardError
from autoshard.modelfile import ModelFile, model_fingerprint
from autoshard.modelfile import load_model_file as _load
from autoshard.runtime.randomness import drawing_freely, fix_randomness

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def load_model_file(spec: str, expected_hash: str | None = None, seq_len: int | None = None) -> ModelFile:
    """Load ``file.py:factory``; with ``expected_hash``, refuse a model the plan was not made for;
    ``seq_len`` (a plan's ``model.seq_len``) is handed to ``example_batch``."""
    model_file = _load(spec, seq_len)
    if expected_hash is not None:
        actual = model_fingerprint(model_file.build("meta"))
        if actual != expected_hash:
            raise AutoshardError(
                f"{spec} is not the model this plan was made for (fingerprint {actual}, plan "
                f"{expected_hash}); re-plan it with `autoshard plan {spec} ...`"
            )
    return model_file


def build_model(
    model_file: ModelFile, seed: int, device: torch.device | str = "cpu", fixed_randomness: bool = False
) -> nn.Module:
    """Build with the same seed on every rank (and in the reference), so weights start equal;
    ``fixed_randomness=True`` gives every random op one value every rank shares (``fix_model_randomness``), as
    ``autoshard verify`` runs."""
    with torch.random.fork_rng(devices=[]), drawing_freely():
        torch.manual_seed(seed)
        model = model_file.build("cpu")
    if fixed_randomness:
        fix_model_randomness(model)
    return model.to(device)


def build_meta_model(
    model_file: ModelFile, seed: int, device: torch.device | str = "cpu", fixed_randomness: bool = False
) -> nn.Module:
    """The model on the meta device, waiting for the plan's ``init_weights`` step to make this rank's shards
    with the values ``build_model(model_file, seed)`` would give (``runtime.init_replay``). A factory whose
    initialisation cannot be replayed is built whole on CPU and moved to ``device`` instead (``build_model``),
    and rank 0 says why in one line. ``fixed_randomness`` as ``build_model``'s."""
    from autoshard.runtime import init_replay

    try:
        with drawing_freely():  # record_build leaves the generator as it found it
            model, record = init_replay.record_build(lambda: model_file.build(None))
    except AutoshardError as exc:  # NotReplayable, or a factory that runs only on real tensors
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {model_file.spec}: built whole on each rank's CPU, then sharded ({exc})", file=sys.stderr)
        return build_model(model_file, seed, device, fixed_randomness)
    init_replay.attach(model, record, seed)
    if fixed_randomness:
        fix_model_randomness(model)
    return model


def strip_wrapper_names(name: str) -> str:
    """A parameter's name in the user's model, without DDP / checkpoint-wrapper parts."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def get_block(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as exc:
        raise AutoshardError(f"the model has no module '{path}' named in the plan; re-plan this model") from exc


def fix_model_randomness(model: nn.Module) -> int:
    """Every random op at a value every rank shares, for the rest of this process (``runtime.randomness``:
    ``autoshard verify``'s runs); the model stays in training mode (BatchNorm keeps using batch statistics).
    Its dropout rates are set to 0 as well (``zero_dropout_rates``: a kernel that drops out inside, such as a
    fused attention's, then never draws). Returns how many rates were set to 0."""
    zeroed = zero_dropout_rates(model)
    fix_randomness()
    return zeroed


def zero_dropout_rates(model: nn.Module) -> int:
    """Set to 0 the ``p`` of dropout modules and the float attributes whose name contains "dropout"
    on modules and on a transformers ``config``; returns how many were not 0."""
    zeroed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p:
            module.p, zeroed = 0.0, zeroed + 1
        zeroed += _zero_dropout_attributes(module)
    config = getattr(model, "config", None)
    if config is not None:
        zeroed += _zero_dropout_attributes(config)
    return zeroed


def _zero_dropout_attributes(obj) -> int:
    names = [k for k, v in vars(obj).items() if "dropout" in k.lower() and isinstance(v, float) and v > 0]
    for name in names:
        setattr(obj, name, 0.0)
    return len(names)


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over a process group for CPU tensors: torch's SyncBatchNorm raises "expected input
    tensor to be on GPU", and DDP refuses it on CPUs ("SyncBatchNorm layers only work with GPU
    modules"), so this is a BatchNorm of its own class.

    The statistics of the whole data-parallel batch, from two differentiable all-reduces
    (``torch.distributed.nn.functional.all_reduce``, whose backward all-reduces the gradients):
    mean = Σx / N, then var = Σ(x − mean)² / N over every rank's elements per channel; the
    output and the running statistics (unbiased var, N/(N−1)) are those of one process that
    saw the whole batch.
    """

    process_group = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not (self.training and dist.is_initialized()):
            return super().forward(input)
        from torch.distributed.nn.functional import all_reduce

        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor(float(input.numel() // input.shape[1]))
        dist.all_reduce(count, group=self.process_group)
        mean = all_reduce(input.sum(dims), group=self.process_group) / count
        centred = input - mean.reshape(shape)
        var = all_reduce(centred.square().sum(dims), group=self.process_group) / count
        self._update_running_stats(mean.detach(), var.detach(), count.item())
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        """Once per forward: a forward run again during backward (activation recompute) leaves them."""
        if not self.track_running_stats or torch._C._current_graph_task_id() != -1:
            return
        self.num_batches_tracked += 1
        momentum = 1.0 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean, momentum)
        self.running_var.lerp_(var * count / max(count - 1, 1.0), momentum)


def convert_sync_batch_norm(model: nn.Module, group, on_cpu: bool | None = None) -> nn.Module:
    """BatchNorm layers take their statistics over the data-parallel group, as one process over the
    global batch would: ``nn.SyncBatchNorm.convert_sync_batchnorm`` on GPUs, ``GlooSyncBatchNorm``
    on CPUs (the same layers, their class changed). A model without BatchNorm is returned as it is.
    ``on_cpu``: where the model runs (default: where its tensors are; a meta model's are nowhere yet)."""
    if not has_batch_norm(model):
        return model
    if not (_on_cpu(model) if on_cpu is None else on_cpu):
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
            module.__class__, module.process_group = GlooSyncBatchNorm, group
    return model


def _on_cpu(module: nn.Module) -> bool:
    tensor = next(iter(module.parameters()), None)
    if tensor is None:
        tensor = next(iter(module.buffers()), None)
    return tensor is None or tensor.device.type == "cpu"


# ---------------------------------------------------------------------------- weight decay


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer, by its type: torch's (LayerNorm, RMSNorm, GroupNorm, LocalResponseNorm, BatchNorm*,
    InstanceNorm*, SyncBatchNorm) or a class named like one (``LlamaRMSNorm``, ``T5LayerNorm``)."""
    return (
        isinstance(
            module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
        )
        or _NORM_CLASS.search(type(module).__name__) is not None
    )


_NORM_CLASS = re.compile(r"Norm(\dd)?$")


def is_embedding(module: nn.Module) -> bool:
    """An embedding table, by its type: ``nn.Embedding`` / ``nn.EmbeddingBag`` or a class named like one
    (tensor_parallel_stages' ``VocabParallelEmbedding``, transformers' scaled word embeddings)."""
    return (
        isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        or _EMBEDDING_CLASS.search(type(module).__name__) is not None
    )


_EMBEDDING_CLASS = re.compile(r"Embedding(Bag)?$")


def no_decay_names(model: nn.Module) -> frozenset[str]:
    """Every name (each alias of a tied tensor, wrapper names stripped) of a parameter that takes no weight
    decay: held by a normalisation layer (``is_norm``) or an embedding (``is_embedding``), or a bias (``bias``,
    ``*_bias``). A tensor tied between an embedding and a head is an embedding's."""
    undecayed = no_decay_params(model)
    return frozenset(
        strip_wrapper_names(name)
        for name, param in model.named_parameters(remove_duplicate=False)
        if id(param) in undecayed
    )


def no_decay_params(model: nn.Module) -> dict[int, nn.Parameter]:
    """``no_decay_names``' parameters, by id."""
    found = {}
    for module in model.modules():
        kind = is_norm(module) or is_embedding(module)
        for name, param in module.named_parameters(recurse=False):
            if kind or name == "bias" or name.endswith("_bias"):
                found[id(param)] = param
    return found


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default floating dtype at ``dtype`` (restored after): a model run in float64 (verify's reference, the
    batch-coupling check) makes the tensors it creates without a dtype in float64 too, a mask or a position table,
    and a value of its weights' dtype fits them (XGLM's ``torch.full((), torch.finfo(weights.dtype).min)`` overflows
    float32)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
