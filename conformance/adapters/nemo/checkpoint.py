"""NeMo Automodel's own checkpoint code, both ways: a draft saved by its checkpointer (what the EAGLE-3 recipe's
save_checkpoint writes, recipes/llm/train_eagle3.py:1611-1676) and a draft directory loaded back by it.

The draft is built as the recipe builds it (train_eagle3.py:610-659): the target's LlamaConfig with the draft
keys set, `LlamaEagle3DraftModel(config).to(dtype)`. Saving goes through `Checkpointer.save_model` with a
consolidated export, which writes `<step>/model/consolidated/` (config.json, one shard and its index); loading
goes through `Checkpointer.load_model` on such a directory.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import tempfile
import warnings
from pathlib import Path

import torch

from conformance.checkpoints import CONFIG_FILE
from conformance.checkpoints.knobs import MLA_MODEL_TYPES

CONSOLIDATED = Path("model") / "consolidated"   # under the recipe's epoch_<E>_step_<S> directory


def draft_config(raw: dict):
    """The draft's config object, as the recipe makes it: the config class of its model_type (the target's,
    `type(draft_base_config).from_dict`, train_eagle3.py:658), with the eager draft attention the recipe sets
    (`draft_attn_implementation`, default "eager", train_eagle3.py:627; not serialized)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[raw.get("model_type", "llama")].from_dict({**raw, "attn_implementation": "eager"})


def draft_class(raw: dict):
    """The draft class the recipe builds for this config: NeMo's own registry on the target's architecture
    (train_eagle3.py:547-552, speculative/eagle/registry.py:156-158), which the saved config does not state (it
    says LlamaEagle3DraftModel for every draft, :613) but its model_type, the target's, does: DeepSeek-V3 targets
    get DeepseekV3Eagle3DraftModel (registry.py:88), the suite's Llama-layer drafts LlamaEagle3DraftModel."""
    from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
    from nemo_automodel.components.speculative.eagle.registry import resolve_eagle3_draft_spec
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type", "llama")
    if model_type not in MLA_MODEL_TYPES:
        return LlamaEagle3DraftModel
    return resolve_eagle3_draft_spec([MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]).draft_cls


def build_draft(raw: dict, dtype: torch.dtype, device: str = "cpu"):
    """The draft built and cast as the recipe does (train_eagle3.py:659). HF initialises its
    parameters from the global generator: forked, so building a draft never moves other tests' streams."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return draft_class(raw)(draft_config(raw)).to(device=device, dtype=dtype)


def checkpointer(root: Path, keys: list[str], consolidated: bool):
    """NeMo's Checkpointer as the recipe configures it (train_eagle3.py:1558-1602), single process."""
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(enabled=True, checkpoint_dir=str(root), model_save_format="safetensors",
                                 save_consolidated=consolidated, is_peft=False, model_state_dict_keys=keys)
    return config.build(dp_rank=0, tp_rank=0, pp_rank=0, moe_mesh=None)


@contextlib.contextmanager
def quiet():
    """NeMo's checkpointer warns about single-process DCP and its consolidation mode on every call."""
    logs = [logging.getLogger(n) for n in ("root", "nemo_automodel")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


@contextlib.contextmanager
def collections_see_only_new_objects():
    """NeMo's Checkpointer.load_model ends in a full gc.collect() (components/checkpoint/checkpointing.py:1207,
    :1460) to free the state dict it read. In a process holding torch, transformers and sglang that collection
    walks millions of long-lived objects: 0.6 s a load, a third of the NeMo lanes' time. Frozen for the load, the
    objects alive before it are out of the collector's reach, so it walks what the load made (and frees it, as
    NeMo intends); after the load they are unfrozen, so nothing is kept past its time (test_nemo_load_collections
    in conformance/meta/test_harness.py). Where a process froze its heap already (the user store, the preloaded
    runner), what is alive now stays frozen with it."""
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


def save_with_nemo(raw_config: dict, stored: dict[str, torch.Tensor], step_dir: Path,
                   dtype: torch.dtype = torch.float32) -> Path:
    """`stored` (NeMo's tensor names) put into the draft the recipe builds from `raw_config`, saved by NeMo's
    checkpointer into `step_dir`; returns the consolidated directory it wrote."""
    model = build_draft(raw_config, dtype)
    missing, unexpected = model.load_state_dict(stored, strict=False)
    if missing or unexpected:
        raise ValueError(f"nemo: tensors the draft does not hold {unexpected}, or lacks {missing}")
    with quiet():
        checkpointer(step_dir.parent, list(model.state_dict()), consolidated=True).save_model(
            model, str(step_dir), tokenizer=None, is_final_checkpoint=True)
    return step_dir / CONSOLIDATED


def load_with_nemo(ckpt_dir: Path, dtype: torch.dtype, device: str = "cpu"):
    """A draft directory loaded by NeMo's checkpointer (`Checkpointer.load_model` on the HF safetensors) into
    the draft the recipe builds from its config.json. Returns the model."""
    raw = json.loads((Path(ckpt_dir) / CONFIG_FILE).read_text())
    model = build_draft(raw, dtype, device)
    # The checkpointer's own directory is where it would save; loading writes nothing, and never into ckpt_dir.
    with quiet(), tempfile.TemporaryDirectory() as scratch, collections_see_only_new_objects():
        checkpointer(Path(scratch), list(model.state_dict()), consolidated=False).load_model(model, str(ckpt_dir))
    return model


def prepare_for_sglang(draft_dir: Path) -> Path:
    """NeMo's own SGLang helper on a directory its checkpointer wrote (`resolve_draft_artifacts(draft, "EAGLE3")`,
    speculative/serve_sglang.py:281-351, what its `serve_sglang --draft DIR` runs before launching SGLang): for the
    consolidated layout it rewrites config.json in place, `architectures` only (:311-321; num_hidden_layers is
    rewritten only by its legacy draft_model.pt export, :274-275), and returns the directory SGLang is given. Its
    missing-token-map warning is quieted: the draft's d2t is in its tensors. Writes into `draft_dir`, as NeMo does."""
    from nemo_automodel.components.speculative.serve_sglang import resolve_draft_artifacts

    with quiet():
        served, _ = resolve_draft_artifacts(str(draft_dir), "EAGLE3")
    return Path(served)
