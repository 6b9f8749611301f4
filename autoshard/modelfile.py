"""Load a model file: ``path/to/file.py:factory`` (the model-file contract in docs/design.md).

A model file defines a factory returning an ``nn.Module`` (it must also work under
``with torch.device("meta")``), ``example_batch(batch_size) -> (inputs: tuple, targets)``
and optionally ``loss_fn(outputs, targets)`` and ``dataset(seq_len)`` (what programs train on: a map-style
``torch.utils.data.Dataset``, or an ``IterableDataset``, of ``(inputs, target)`` samples, each one row of ``example_batch``: ``inputs`` a tuple
of tensors without the batch dimension; ``seq_len`` None means the file's own length). Without ``loss_fn`` the default is
cross-entropy when the targets are integer class ids (outputs ``(..., classes)``, targets
``(...)``) and mean squared error otherwise; an output object with a ``logits`` attribute
(Hugging Face models) is reduced to its logits first.

The file runs only when the user names it; nothing else executes user code.

``hf:DIR`` names a transformers causal LM by its folder (``config.json``, as ``save_pretrained`` writes it)
without a model file: ``hf_causal_lm`` makes the contract (``AutoModelForCausalLM.from_config``, fp32 weights,
SDPA attention, no cache; examples/gpt.py's learnable synthetic tokens; cross-entropy on the logits). Only the
JSON is read: a config that asks for code of its own (``auto_map``) is refused by transformers.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import inspect
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autoshard.errors import AutoshardError
from autoshard.ir.plan import HF_PREFIX
from autoshard.narrowing import narrowed_config, text_config

# What the user's code may raise that becomes a one-line error: any exception, and exit()
# (a script's argparse or sys.exit must not end autoshard silently with its own status).
USER_CODE_ERRORS = (Exception, SystemExit)


@dataclass
class ModelFile:
    """A loaded model file and the callables of its contract."""

    spec: str  # as the user gave it, e.g. "examples/gpt.py:build"
    path: Path
    factory_name: str
    module: types.ModuleType
    seq_len: int | None = None  # --seq-len: example_batch(batch_size, seq_len=...) (None: the file's own)
    # where the file's own length is every position the model has (hf:DIR's default): that length, else None
    length_at_positions: int | None = None

    @property
    def factory(self) -> Callable[[], nn.Module]:
        return getattr(self.module, self.factory_name)

    def build(self, device: str | torch.device | None = "cpu") -> nn.Module:
        """Call the factory under ``torch.device(device)`` (None: under no device context, as
        ``runtime.init_replay`` records it); errors name the file and factory."""
        try:
            context = contextlib.nullcontext() if device is None else torch.device(device)
            with context, _skip_init_on_meta(device), warnings.catch_warnings():
                # torch's init warns on zero-size weights; _check_parameters then names the layer
                warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
                model = self.factory()
        except AutoshardError:
            raise
        except USER_CODE_ERRORS as exc:  # the user's code failed: say where, keep one line
            raise AutoshardError(
                f"{self.spec}: the factory raised {type(exc).__name__}: {_first_line(exc)}; "
                f"fix the model file (run it with --debug for the traceback)"
            ) from exc
        if not isinstance(model, nn.Module):
            raise AutoshardError(
                f"{self.spec}: the factory returned {type(model).__name__}, not a torch.nn.Module; "
                f"make {self.factory_name}() return the model"
            )
        model = _uncompiled(self.spec, model)
        _check_parameters(self.spec, model)
        return model

    def example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``(inputs, targets)`` with inputs a tuple of tensors, checked against the contract."""
        fn = getattr(self.module, "example_batch", None)
        if fn is None:
            raise AutoshardError(
                f"{self.path}: no example_batch(batch_size) function; add one returning "
                f"(inputs: tuple, targets) for a batch of that size"
            )
        kwargs = {} if self.seq_len is None else {"seq_len": self.seq_len}
        if kwargs:
            _check_takes_seq_len(self.path, fn)
        try:
            batch = fn(batch_size, **kwargs)
        except USER_CODE_ERRORS as exc:
            raise AutoshardError(
                f"{self.path}: example_batch({batch_size}{''.join(f', seq_len={v}' for v in kwargs.values())}) "
                f"raised {type(exc).__name__}: {_first_line(exc)}; fix the model file"
            ) from exc
        inputs, targets = _check_batch(self.path, batch, batch_size)
        if self.seq_len is not None and (inputs[0].dim() < 2 or inputs[0].shape[1] != self.seq_len):
            raise AutoshardError(
                f"{self.path}: example_batch({batch_size}, seq_len={self.seq_len}) returned inputs "
                f"of shape {tuple(inputs[0].shape)}; the first input needs seq_len tokens as its "
                f"second dimension"
            )
        return inputs, targets

    @property
    def has_dataset(self) -> bool:
        """The file defines ``dataset(seq_len)``: programs train on it rather than on ``example_batch`` draws."""
        return callable(getattr(self.module, "dataset", None))

    def dataset(self):
        """The file's ``dataset(seq_len)`` (``seq_len`` None: the file's own length), errors naming the file: a
        ``torch.utils.data.Dataset`` of ``(inputs, target)`` samples shaped like one row of ``example_batch``
        (``runtime.data.check_samples`` checks it)."""
        try:
            return self.module.dataset(self.seq_len)
        except USER_CODE_ERRORS as exc:
            raise AutoshardError(
                f"{self.path}: dataset(seq_len={self.seq_len}) raised {type(exc).__name__}: "
                f"{_first_line(exc)}; fix the model file"
            ) from exc

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        fn = getattr(self.module, "loss_fn", None)
        if fn is not None:
            return fn(outputs, targets)
        return default_loss(outputs, targets)


_COMPILE_NOTED: set[str] = set()


def _uncompiled(spec: str, model: nn.Module) -> nn.Module:
    """``model`` with ``torch.compile`` taken off: the module it compiles (``OptimizedModule._orig_mod``) where the
    factory returned ``torch.compile(model)``, and each compiled submodule replaced by its own. A compiled module
    is a wrapper: its parameters are named ``_orig_mod.*``, ``parallelize_module`` and the capture's stand-ins
    cannot replace its children, and DTensor, FSDP2 and pipeline stages want the eager module. Capture, plans and
    programs all build the model here, so all of them name the same parameters. Said once per process."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # imported by anything torch.compile returned
    if eval_frame is None:
        return model
    compiled = eval_frame.OptimizedModule
    outer = isinstance(model, compiled)
    while isinstance(model, compiled):
        model = model._orig_mod
    inner: list[str] = []

    def take_off(module: nn.Module, prefix: str) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            path = f"{prefix}{name}"
            if isinstance(child, compiled):
                while isinstance(child, compiled):
                    child = child._orig_mod
                module._modules[name] = child
                inner.append(path)
            take_off(child, f"{path}.")

    take_off(model, "")
    if (outer or inner) and spec not in _COMPILE_NOTED:
        _COMPILE_NOTED.add(spec)
        shown = ", ".join(inner[:3]) + (f" and {len(inner) - 3} more" if len(inner) > 3 else "")
        what = (
            "returned torch.compile(model); autoshard plans and runs the module it compiles (model._orig_mod)"
            if outer
            else f"compiles submodules {shown} (torch.compile); autoshard plans and runs them as they "
            f"are (each one's _orig_mod)"
        )
        if outer and inner:
            what += f", and its submodules {shown} uncompiled too"
        print(
            f"note: {spec}: the factory {what}; its program applies the plan's parallelism to the eager module "
            f"and does not compile it",
            file=sys.stderr,
        )
    return model


class _SkipMetaInit(TorchFunctionMode):
    """In-place random fills of meta tensors return at once: a meta tensor has no values to fill,
    yet each ``normal_`` / ``uniform_`` costs ~2 ms of Python decompositions, 0.5-1.5 s per model build
    (torch has no switch for this: ``skip_init`` needs the module's constructor)."""

    FILLS = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            torch.Tensor.random_,
            torch.Tensor.bernoulli_,
            torch.Tensor.exponential_,
            torch.Tensor.geometric_,
            torch.Tensor.log_normal_,
            torch.Tensor.cauchy_,
            torch.Tensor.erfinv_,
        }
        # nn.init's initialisers reach modes as themselves (handle_torch_function)
        | {
            getattr(nn.init, name)
            for name in dir(nn.init)
            if name.endswith("_") and not name.startswith("_") and callable(getattr(nn.init, name))
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _skip_init_on_meta(device: str | torch.device):
    return _SkipMetaInit() if device is not None and torch.device(device).type == "meta" else contextlib.nullcontext()


def model_fingerprint(model: nn.Module) -> str:
    """sha256 of the model's structure: module types, parameter and buffer names, shapes, dtypes.

    Weights' values do not enter, so a meta-device build gives the same fingerprint.
    """
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"m {name} {type(module).__name__}\n".encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"t {name} {tuple(t.shape)} {t.dtype}\n".encode())
    return h.hexdigest()[:16]


def default_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets, mean squared error otherwise (see module doc)."""
    if hasattr(outputs, "logits"):
        outputs = outputs.logits
    if isinstance(outputs, (tuple, list)):
        outputs = outputs[0]
    if not targets.dtype.is_floating_point and outputs.dim() == targets.dim() + 1:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
    return F.mse_loss(outputs, targets)


def load_model_file(spec: str, seq_len: int | None = None) -> ModelFile:
    """Import ``file.py:factory``; the file's directory goes on ``sys.path`` for its imports. ``seq_len``
    (``--seq-len``) is handed to ``example_batch``."""
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise AutoshardError(f"--seq-len {seq_len} must be a positive integer")
    if spec.startswith(HF_PREFIX):
        return hf_causal_lm(spec, seq_len)
    if ":" not in spec:
        raise AutoshardError(
            f"model '{spec}' has no factory: write it as path/to/file.py:factory, e.g. examples/gpt.py:build"
        )
    file_part, factory_name = spec.rsplit(":", 1)
    path = Path(file_part)
    if path.is_dir():
        raise AutoshardError(
            f"model file '{file_part}' is a folder, not a file; name the Python file that "
            f"defines the factory, e.g. {file_part.rstrip('/')}/model.py:{factory_name or 'build'}"
        )
    if not path.is_file():
        raise AutoshardError(f"model file '{file_part}' not found; check the path (relative to {Path.cwd()})")
    if path.suffix != ".py":
        raise AutoshardError(f"model file '{file_part}' is not a Python file; a model is path/to/file.py:factory")
    module = _import_file(path, spec)
    if not factory_name.isidentifier() or not callable(getattr(module, factory_name, None)):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AutoshardError(
            f"{path}: no function '{factory_name}'; name one of: {', '.join(names[:8]) or 'none defined'}"
        )
    _check_factory_takes_no_arguments(path, factory_name, getattr(module, factory_name))
    return ModelFile(spec=spec, path=path, factory_name=factory_name, module=module, seq_len=seq_len)


HF_DEFAULT_SEQ_LEN = 2048  # hf:DIR's tokens per sample without --seq-len (at most the model's positions)


def hf_causal_lm(spec: str, seq_len: int | None = None) -> ModelFile:
    """The model-file contract for ``hf:DIR`` (module doc): ``build``, ``example_batch(batch_size, seq_len)``;
    the default loss (cross-entropy on ``outputs.logits`` against the next tokens)."""
    folder = Path(spec[len(HF_PREFIX) :])
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise AutoshardError(
            f"'{folder}' has no config.json; hf:DIR names a transformers model's folder (as "
            f"save_pretrained writes it), e.g. hf:models/llama"
        )
    return _hf_model_file(spec, _hf_config(folder), config_path, seq_len)


def _hf_model_file(spec: str, config, config_path: Path, seq_len: int | None) -> ModelFile:
    """The contract of ``hf_causal_lm`` for a transformers ``config``; its module's ``narrowed()`` is the same for
    ``narrowed_config(config)`` (what checks run on where the model is too large to run whole). A composite config
    (a text model's beside a vision or audio tower's) gives its text config's vocabulary and positions."""
    text = text_config(config)
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    offset = position_offset(config)
    if positions and offset:
        if seq_len is not None and seq_len > positions - offset:
            raise AutoshardError(
                f"--seq-len {seq_len}: {type(config).__name__} numbers positions from pad_token_id + 1 = {offset}, "
                f"so its {positions} position rows hold {positions - offset} tokens; pass --seq-len "
                f"{positions - offset} or less"
            )
        positions -= offset
    default_seq = min(positions or HF_DEFAULT_SEQ_LEN, HF_DEFAULT_SEQ_LEN)

    def build() -> nn.Module:
        import transformers

        # fp32 whatever dtype the config names (fp32 master weights); transformers < 5 calls the keyword torch_dtype
        fp32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
        try:
            return transformers.AutoModelForCausalLM.from_config(_fresh(config), attn_implementation="sdpa", **fp32)
        except ValueError:  # an architecture without SDPA: its own attention, on a config the refusal did not touch
            return transformers.AutoModelForCausalLM.from_config(_fresh(config), **fp32)

    def example_batch(batch_size: int, seq_len: int | None = None):
        """examples/gpt.py's sequences: arithmetic progressions modulo the vocabulary, the next token the target."""
        seq = seq_len or default_seq
        start = torch.randint(0, text.vocab_size, (batch_size, 1))
        step = torch.randint(1, 8, (batch_size, 1))
        tokens = (start + step * torch.arange(seq + 1)) % text.vocab_size
        return (tokens[:, :-1],), tokens[:, 1:]

    def narrowed() -> ModelFile:
        return _hf_model_file(f"{spec} (narrowed)", narrowed_config(config), config_path, None)

    module = types.ModuleType(
        f"autoshard_hf_{hashlib.sha1(str(config_path.parent.resolve()).encode()).hexdigest()[:12]}"
    )
    module.build, module.example_batch, module.narrowed = build, example_batch, narrowed
    at_positions = default_seq if seq_len is None and positions and default_seq == positions else None
    return ModelFile(
        spec=spec,
        path=config_path,
        factory_name="build",
        module=module,
        seq_len=seq_len,
        length_at_positions=at_positions,
    )


def _fresh(config):
    """A copy of ``config`` for one build: transformers writes into the config it builds from (the attention
    implementation asked for, even when it then refuses it), and a cache object has no place in a traced graph."""
    fresh = copy.deepcopy(config)
    fresh.use_cache = text_config(fresh).use_cache = False
    return fresh


def position_offset(config) -> int:
    """The rows of the position table a transformers causal LM never reads before its first token's: RoBERTa's
    embeddings (CamemBERT's, Data2VecText's, XLM-R's, ...) number a sequence's positions from ``pad_token_id + 1``
    (``create_position_ids_from_input_ids``), so of ``max_position_embeddings`` rows only that many fewer tokens fit
    (roberta-base: 514 rows, 512 tokens). 0 for every other model."""
    import transformers

    try:
        model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError, AttributeError):
        return 0
    module = sys.modules.get(model_class.__module__)
    counts_from_padding = any(
        inspect.isclass(value) and name.endswith("Embeddings") and hasattr(value, "create_position_ids_from_input_ids")
        for name, value in vars(module or types.ModuleType("none")).items()
    )
    pad = getattr(config, "pad_token_id", None)
    return pad + 1 if counts_from_padding and isinstance(pad, int) and pad >= 0 else 0


def _hf_config(folder: Path):
    """transformers' config of ``folder``, a causal LM's, or one line saying why not."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except USER_CODE_ERRORS as exc:
        raise AutoshardError(
            f"{folder / 'config.json'}: transformers cannot read it ({type(exc).__name__}: "
            f"{_first_line(exc)}); give the folder save_pretrained wrote"
        ) from exc
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise AutoshardError(
            f"{folder / 'config.json'}: a {type(config).__name__} has no causal LM in transformers "
            f"(hf:DIR plans causal LMs); write a model file for it (docs/design.md's contract)"
        )
    return config


def _check_takes_seq_len(path: Path, fn: Callable) -> None:
    """--seq-len needs ``example_batch(batch_size, seq_len=...)`` (docs/design.md's model file contract)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if "seq_len" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise AutoshardError(
            f"{path}: example_batch takes no seq_len, so --seq-len cannot set the sequence length; "
            f"add a parameter: def example_batch(batch_size, seq_len=...)"
        )


def _check_factory_takes_no_arguments(path: Path, name: str, factory: Callable) -> None:
    """autoshard calls the factory with no arguments: one that needs some is named here, not blamed later on
    the meta device."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or a class without a signature: calling it will tell
        return
    needed = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if needed:
        raise AutoshardError(
            f"{path}: the factory {name}() needs the argument(s) {', '.join(needed[:4])}; autoshard "
            f"calls it with none: give them defaults, or add a factory that takes no arguments"
        )


def _import_file(path: Path, spec: str) -> types.ModuleType:
    # An edited file is imported again, not served from sys.modules: keyed by content, since an
    # edit can keep the size and the timestamp (two saves within the file system's clock tick).
    key = f"{path.resolve()}:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    name = "autoshard_user_model_" + hashlib.sha1(key.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    import_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(import_spec)
    sys.path.insert(0, str(path.resolve().parent))
    # no __pycache__ left in the user's folder (the file and the siblings it imports)
    dont_write_before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        sys.modules[name] = module
        import_spec.loader.exec_module(module)
    except USER_CODE_ERRORS as exc:
        sys.modules.pop(name, None)
        raise AutoshardError(
            f"{path}: importing the model file raised {type(exc).__name__}: {_first_line(exc)}; fix the file"
        ) from exc
    finally:
        sys.path.remove(str(path.resolve().parent))
        sys.dont_write_bytecode = dont_write_before
    return module


def _check_batch(path: Path, batch: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise AutoshardError(f"{path}: example_batch must return (inputs: tuple, targets), got {type(batch).__name__}")
    inputs, targets = batch
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    tensors = list(inputs) + ([targets] if isinstance(targets, torch.Tensor) else [])
    if not tensors or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise AutoshardError(f"{path}: example_batch inputs must be a tuple of tensors")
    for t in tensors:
        if t.dim() == 0 or t.shape[0] != batch_size:
            raise AutoshardError(
                f"{path}: example_batch({batch_size}) returned a tensor of shape {tuple(t.shape)}; "
                f"every input and target needs the batch ({batch_size}) as its first dimension"
            )
        if 0 in t.shape:
            raise AutoshardError(
                f"{path}: example_batch({batch_size}) returned a tensor of shape {tuple(t.shape)} with a "
                f"zero-size dimension; give every dimension at least one element"
            )
    return tuple(inputs), targets


def _check_parameters(spec: str, model: nn.Module) -> None:
    """No weight of zero elements: a width of 0 is a typo, not a layer (capture checks there are weights)."""
    for name, p in model.named_parameters():
        if p.numel() == 0:
            raise AutoshardError(
                f"{spec}: parameter '{name}' has shape {tuple(p.shape)}, a zero-size dimension; "
                f"give every layer a width of at least 1"
            )


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"exit({exc.code!r}) was called; a model file defines functions and must not exit"
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
