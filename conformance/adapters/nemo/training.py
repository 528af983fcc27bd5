"""NeMo Automodel 0.7.0's own EAGLE-3 training path, as the trained-draft fixture and the acceptance prediction
drive it (the adapter's `training` capability; speculators' is conformance/adapters/speculators/training.py).

Everything here calls NeMo's code as its recipe wires it (recipes/llm/train_eagle3.py): its co-located HF target
(`HFEagle3TargetModel.generate_batch`: its default aux layers, the shifted logits, ids and loss mask, target.py),
its draft vocabulary (`build_eagle3_token_mapping`, datasets/llm/eagle3.py:249-376), the draft built, seeded from
the target's embeddings, vocab-mapped and frozen as setup() does (train_eagle3.py:610-680), its TTT trainer
(`Eagle3TrainerModule.forward`, core.py: soft cross-entropy weighted 0.8^k, accuracy and the per-TTT-step
prefix counts behind `train_tau_sim`), AdamW and the warmup-cosine schedule and grad clipping of its loop
(train_eagle3.py:771-822, 2078-2081), and its checkpointer's save (Checkpointer.save_model, consolidated).
Nothing re-implements their math. `recipe` arguments are conformance.acceptance.trained_draft.Recipe (read by
field name); the recipe's loss, attention and ttt_step_loss_decay are speculators' knobs: NeMo's TTT loss is its
own (soft CE, decay 0.8 fixed, core.py:400-410) and its draft attention eager (the recipe's default).

The data as NeMo's chat datasets mark it: the random prompt tokens unsupervised (loss_mask 0), the target's greedy
continuation supervised (1); generate_batch shifts the mask with the ids, so slot t (aux h_t, token x_{t+1},
predicting x_{t+2}) is supervised from t = 1 on, the rows a verify round can start at.
"""
from __future__ import annotations

import contextlib
import math
import tempfile
import warnings
from pathlib import Path

import torch

from conformance.adapters.nemo.checkpoint import CONSOLIDATED, checkpointer, quiet

ADAM_BETAS = (0.9, 0.95)   # the recipe's default optimizer betas (train_eagle3.py:776)
WARMUP_RATIO, MIN_LR_RATIO = 0.05, 0.1   # its schedule defaults (train_eagle3.py:815-816)
MAX_GRAD_NORM = 1.0        # recipe_args.max_grad_norm default (train_eagle3.py:781)


def loss_mask(ids: torch.Tensor, prompt_tokens: int) -> torch.Tensor:
    """[B, T]: 0 on the prompt, 1 on the continuation (what NeMo's datasets mark as the assistant's tokens)."""
    mask = torch.ones_like(ids)
    mask[:, :prompt_tokens] = 0
    return mask


def target_backend(target):
    """NeMo's co-located target around the suite's tiny target model, with its default aux layers
    (default_eagle3_aux_layer_ids: outputs of layers [1, N//2 - 1, N - 4], target.py:42-61)."""
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel

    return HFEagle3TargetModel(target.model)


def target_batch(backend, ids: torch.Tensor, prompt_tokens: int):
    """NeMo's supervision for `ids` (generate_batch: aux states, logits / ids / loss mask shifted left by one)."""
    return backend.generate_batch(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  loss_mask=loss_mask(ids, prompt_tokens))


def draft_vocabulary(train_ids: torch.Tensor, recipe, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(selected_token_ids, selected_token_mask): NeMo's frequency-built draft vocabulary over the supervised
    tokens (build_eagle3_token_mapping; no tokenizer here, so no special tokens are forced in)."""
    from nemo_automodel.components.datasets.llm.eagle3 import build_eagle3_token_mapping

    batches = [{"input_ids": train_ids, "loss_mask": loss_mask(train_ids, recipe.prompt_tokens)}]
    with quiet():   # its progress bar and frequency log
        return build_eagle3_token_mapping(batches, target_vocab_size=vocab_size,
                                          draft_vocab_size=recipe.draft_vocab_size, special_token_ids=None)


def make_draft_model(recipe, target_dir: Path, target, selected: torch.Tensor):
    """The draft as the recipe's setup builds it (train_eagle3.py:610-680): the target's config with the draft
    keys, the draft class NeMo's registry gives the target (LlamaEagle3DraftModel; DeepseekV3Eagle3DraftModel, MLA,
    for a DeepSeek-V3 target), embeddings copied from the target and frozen, d2t/t2d from the vocabulary."""
    from transformers import AutoConfig

    from conformance.adapters.nemo.checkpoint import draft_class

    base = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    raw = base.to_dict()
    raw.update(draft_vocab_size=int(selected.numel()), target_hidden_size=base.hidden_size,
               architectures=["LlamaEagle3DraftModel"], tie_word_embeddings=False, attn_implementation="eager",
               fc_norm=False, norm_output=False, parallel_drafting=False)
    with torch.random.fork_rng():   # HF initialises from the global generator; forked, restored
        torch.manual_seed(recipe.train_seed)
        model = draft_class(raw)(type(base).from_dict(raw)).to(torch.float32)
    model.copy_embeddings_from_target(target.model.get_input_embeddings())
    model.set_vocab_mapping(selected)
    model.freeze_embeddings()
    return model


def trainer_module(model, selected: torch.Tensor, mask: torch.Tensor, steps: int):
    from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule

    return Eagle3TrainerModule(model, selected_token_ids=selected, selected_token_mask=mask, ttt_steps=steps)


def schedule(optimizer, total: int):
    from nemo_automodel.recipes.llm._spec_train_utils import make_warmup_cosine_schedule

    warmup = max(1, int(WARMUP_RATIO * total))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, make_warmup_cosine_schedule(warmup, total, MIN_LR_RATIO))


def tau_sim(metrics) -> float:
    """NeMo's logged train_tau_sim for one step's counts (simulated_accept_length, core.py:200-222)."""
    from nemo_automodel.components.speculative.eagle.core import simulated_accept_length

    return float(simulated_accept_length(metrics.step_prefix_hits, metrics.step_valid))


def train(recipe, module, backend, train_ids: torch.Tensor) -> list[dict]:
    """NeMo's training loop for `recipe.optimizer_steps` steps of `recipe.sequences_per_step` sequences (one
    micro-batch per step), the sequences reshuffled every epoch from the seeded generator as its sampler does;
    returns a log of (step, loss, accuracy, per-TTT-step prefix accuracy, tau_sim) every 50 steps."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=ADAM_BETAS, weight_decay=0.0)
    lr = schedule(optimizer, recipe.optimizer_steps)
    pick = torch.Generator().manual_seed(recipe.train_seed)
    order: list[int] = []
    log = []
    module.train()
    for step in range(recipe.optimizer_steps):
        if len(order) < recipe.sequences_per_step:
            order += torch.randperm(train_ids.shape[0], generator=pick).tolist()
        chosen, order = order[:recipe.sequences_per_step], order[recipe.sequences_per_step:]
        batch = target_batch(backend, train_ids[chosen], recipe.prompt_tokens)
        metrics = module(**batch.to_trainer_inputs())
        metrics.loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        lr.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step + 1 == recipe.optimizer_steps:
            hits, valid = metrics.step_prefix_hits.float(), metrics.step_valid.float().clamp_min(1.0)
            log.append({"step": step, "loss": round(float(metrics.loss.detach()), 4),
                        "acc": round(float(metrics.accuracy), 3),
                        "full_acc": [round(float(h / v), 3) for h, v in zip(hits, valid)],
                        "tau_sim": round(tau_sim(metrics), 3)})
    module.eval()
    return log


def save(model, directory: Path) -> Path:
    """The trained draft written by NeMo's checkpointer, as the recipe's final save writes it; returns the
    consolidated directory (config.json, one shard and its index)."""
    step_dir = directory / "epoch_0_step_0"
    with quiet():
        checkpointer(directory, list(model.state_dict()), consolidated=True).save_model(
            model, str(step_dir), tokenizer=None, is_final_checkpoint=True)
    return step_dir / CONSOLIDATED


def train_draft(recipe, target, target_dir: Path, train_ids: torch.Tensor) -> dict:
    """The whole build (the `training` capability's entry, as for every trainer): NeMo's vocabulary, draft and
    training loop, then NeMo's own save, read back by the suite's parser of NeMo's format.
    -> {"config": Eagle3Config, "weights": the draft's tensors by canonical name, "log": ..., "draft_vocab":
    target ids of the draft vocabulary}."""
    from conformance.checkpoints import read_config, read_weights

    vocab = target.model.config.vocab_size
    selected, mask = draft_vocabulary(train_ids, recipe, vocab)
    model = make_draft_model(recipe, target_dir, target, selected)
    module = trainer_module(model, selected, mask, recipe.ttt_steps)
    log = train(recipe, module, target_backend(target), train_ids)
    with tempfile.TemporaryDirectory() as scratch:
        saved = save(model, Path(scratch))
        cfg, weights = read_config(saved), read_weights(saved)
    return {"config": cfg, "weights": weights, "log": log, "draft_vocab": selected}


# ---------------------------------------------------------------- the prediction: NeMo's metrics on held-out data

@contextlib.contextmanager
def scored_starts():
    """What NeMo's metrics score per slot while heldout_scores runs (observation only).

    Yields a list that gets, per forward and TTT step k in call order, NeMo's own inputs to that step's loss
    (masked_soft_cross_entropy, looked up in core.py's namespace at every step): the draft logits, the target
    distribution and the step's position mask. From them heldout_scores forms the per-slot hits
    (core.py:489-497: argmax equal and supervised, ANDed over the steps) and checks that they add up to the
    step_prefix_hits NeMo returns, so what is observed is what NeMo scored. The original runs unchanged.
    """
    from nemo_automodel.components.speculative.eagle import core

    original = core.masked_soft_cross_entropy
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def observed(*, logits, target_probs, position_mask, **kwargs):
        seen.append((logits.detach().argmax(-1), target_probs.detach().argmax(-1), position_mask.detach().squeeze(-1)))
        return original(logits=logits, target_probs=target_probs, position_mask=position_mask, **kwargs)

    core.masked_soft_cross_entropy = observed
    try:
        yield seen
    finally:
        core.masked_soft_cross_entropy = original


def heldout_scores(adapter, trained, target, steps: int) -> dict:
    """NeMo's TTT forward with its metrics on the held-out sequences of `trained` (the acceptance area's
    TrainedDraft) in one batch, the draft loaded through `adapter` (the NeMo adapter class, passed in: it imports
    this module) with its saved vocabulary (LoadedNemo.trainer), the teacher from NeMo's co-located target.
    -> {"full_acc": per step prefix hits / valid (what train_tau_sim sums), "cond_acc", "starts",
    "tau_sim": NeMo's simulated_accept_length, "correct": [sequences, T - 1, steps] per start row}.
    """
    heldout_ids, prompt_tokens = trained.heldout_ids, trained.recipe.prompt_tokens
    loaded = adapter().load(trained.checkpoints[adapter.checkpoint_format], torch.float32)
    module = loaded.trainer(steps)
    batch = target_batch(target_backend(target), heldout_ids, prompt_tokens)
    with torch.no_grad(), scored_starts() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = module(**batch.to_trainer_inputs())
    if len(seen) != steps:
        raise RuntimeError(f"nemo scored {len(seen)} TTT steps, expected {steps}")
    S, T = heldout_ids.shape
    prefix = torch.ones(S, T, dtype=torch.bool)
    correct = torch.zeros(S, T - 1, steps, dtype=torch.bool)
    for k, (drafted, expected, supervised) in enumerate(seen):
        prefix &= (drafted == expected) & supervised.bool()
        correct[:, :, k] = prefix[:, :T - 1]   # slot T - 1 is never supervised (the 0-filled shift)
    observed = [int(correct[:, :, k].sum()) for k in range(steps)]
    reported = [int(h) for h in metrics.step_prefix_hits]
    if observed != reported:
        raise RuntimeError(f"per-row scores {observed} do not add up to NeMo's step_prefix_hits {reported}")
    hits, valid = metrics.step_prefix_hits.double(), metrics.step_valid.double()
    full = (hits / valid).tolist()
    # NeMo logs no conditional accuracy: P(step k right | steps < k right), from its own prefix counts.
    cond = [full[0]] + [float(hits[k] / hits[k - 1]) if hits[k - 1] else math.nan for k in range(1, steps)]
    return {"full_acc": full, "cond_acc": cond, "starts": int(valid[0]), "tau_sim": tau_sim(metrics),
            "correct": correct}

