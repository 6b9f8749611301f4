"""``hf:DIR``: transformers causal LMs planned and verified from a saved ``config.json``, with no model file.

Three architectures at their library defaults but for the sizes (``save_pretrained`` of a config, no weights):
Llama (rotary, GQA, SiLU MLP), Qwen2 (biased q/k/v) and GPT-2 (learned positions, tied embeddings, Conv1D),
each planned by ``autoshard.plan("hf:DIR", ...)`` on 2 CPU ranks as a user would, and verified in the session's
2-rank launch (``one_launch.verify_cases``). Llama again at tp 2 with loss parallelism pinned: its logits on
vocabulary shards and the cross-entropy computed on them (torch's ``loss_parallel``), trained like one process;
and on 4 ranks in two pipeline stages of tp 2 (the session's 4-rank launch), the last stage handing the schedule's
loss its vocabulary shard.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest

import autoshard
from e2e.one_launch import Cases, verify_cases

pytestmark = pytest.mark.e2e

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=32,
)
RANKS = 2


def _config(name: str):
    import transformers as tf

    return {
        "llama": lambda: tf.LlamaConfig(**SIZES, num_key_value_heads=2),
        "qwen2": lambda: tf.Qwen2Config(**SIZES, num_key_value_heads=2),
        "gpt2": lambda: tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32),
    }[name]()


CASES = ("llama", "qwen2", "gpt2")
LOSS_PARALLEL = "llama-loss-parallel"  # the llama folder, tp 2, the loss on vocabulary shards
STAGES_LOSS_PARALLEL = "llama-stages-loss-parallel"  # the same, in 2 pipeline stages (pp 2 x tp 2)


@cache
def folder(name: str) -> Path:
    """The config saved as save_pretrained writes it, in a folder of its own for the session."""
    path = Path(tempfile.mkdtemp(prefix=f"autoshard-hf-{name}-"))
    atexit.register(shutil.rmtree, path, True)  # the session's: gone at its end
    _config(name).save_pretrained(path)
    return path


def _plan(name: str):
    if name == STAGES_LOSS_PARALLEL:
        return autoshard.plan(
            f"hf:{folder('llama')}",
            cluster="local-cpu",
            devices_per_node=2 * RANKS,
            global_batch=8,
            tp=2,
            pp=2,
            loss_parallel=True,
        )
    if name == LOSS_PARALLEL:
        return autoshard.plan(
            f"hf:{folder('llama')}",
            cluster="local-cpu",
            devices_per_node=RANKS,
            global_batch=8,
            tp=2,
            loss_parallel=True,
        )
    return autoshard.plan(f"hf:{folder(name)}", cluster="local-cpu", devices_per_node=RANKS, global_batch=8)


LAUNCHES = Cases(
    {**dict.fromkeys((*CASES, LOSS_PARALLEL), RANKS), STAGES_LOSS_PARALLEL: 2 * RANKS},
    *verify_cases(_plan, lambda name: 2 if name == STAGES_LOSS_PARALLEL else 3),  # two: the first update carried on
    case_of=lambda test, params: params.get("name", STAGES_LOSS_PARALLEL if "stages" in test else LOSS_PARALLEL),
)


@pytest.mark.parametrize("name", CASES)
def test_a_saved_config_plans_and_trains_like_one_process(launches, name):
    plan, report = launches.result(LAUNCHES, name)
    assert plan.model["spec"] == f"hf:{folder(name)}" and plan.model.get("seq_len") is None
    assert plan.model["layers"] == 2 and plan.world_size == RANKS
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]  # it trains


def test_loss_parallelism_trains_like_one_process(launches):
    """lm_head's logits stay sharded on the vocabulary over the 2 ranks (ColwiseParallel with a Shard(-1) output),
    the cross-entropy runs on the shards under loss_parallel, and the losses and weights match one process."""
    plan, report = launches.result(LAUNCHES, LOSS_PARALLEL)
    assert plan.decisions.loss_parallel and plan.mesh.tp == 2
    assert plan.tensor_parallel["lm_head"].startswith("colwise-loss-parallel")
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]


def test_loss_parallelism_in_pipeline_stages_trains_like_one_process(launches):
    """In two stages of tp 2 the last stage's lm_head keeps its rows of the weight and returns its vocabulary shard;
    the schedule's loss reads it as a Shard(-1) DTensor under loss_parallel, and the losses and weights match one
    process."""
    plan, report = launches.result(LAUNCHES, STAGES_LOSS_PARALLEL)
    assert plan.decisions.loss_parallel and (plan.mesh.tp, plan.mesh.pp) == (2, 2)
    assert plan.tensor_parallel["lm_head"].startswith("colwise-loss-parallel")
    assert report.ok, report.failure
    assert report.parallel_losses[-1] < report.parallel_losses[0]
