"""speculators' own training path, as the trained-draft fixture and the acceptance prediction drive it.

Everything here calls speculators 0.9.0's code (its dataset layout, CollateFn + shift_batch, vocab
mapping, `from_training_args`, losses and metrics); nothing re-implements it. `recipe` arguments are
conformance.acceptance.trained_draft.Recipe (read by field name).
"""
from __future__ import annotations

import contextlib
import tempfile
import warnings
from pathlib import Path

import torch

from reference.eagle3 import DraftBatch

# extend_mask_for_draft_tokens appends one KV block per query block, which lines up with the keys of
# the next TTT step only when the packed length is a multiple of the block size (models/eagle3/
# attention.py:37-112; create_block_mask's default, which core.py:149-161 keeps); flex attention refuses
# any other length. Training pads every batch to total_seq_len (train/data.py:374-443), and so does
# training_layout here.
FLEX_BLOCK = 128

FORWARD_KEYS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids",
                "verifier_last_hidden_states")


def speculators_items(ids: torch.Tensor, aux: torch.Tensor, last: torch.Tensor) -> list[dict]:
    """One sample per sequence in speculators' dataset layout (train/data.py:32-55), loss on every token:
    with a 2-token prompt every row's teacher-forced tokens are the target's own greedy tokens."""
    T = ids.shape[1]
    return [{"input_ids": ids[i], "hidden_states": aux[i], "verifier_last_hidden_states": last[i],
             "loss_mask": torch.ones(T, dtype=torch.bool), "lengths": torch.tensor([T]),
             "position_ids": torch.arange(T)} for i in range(ids.shape[0])]


def training_layout(model, batch: DraftBatch, aux: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The forward's inputs as speculators' own CollateFn lays out a training batch (train/data.py:374-443):
    the packed rows, zero-padded to a multiple of FLEX_BLOCK, document ids from the sequence lengths and
    -1 on padding, which its document mask keeps out of every real row's attention (attention.py:22-27)."""
    from speculators.train.data import CollateFn

    T = batch.input_ids.shape[0]
    lengths = torch.bincount(batch.seq_ids.cpu())
    item = {"hidden_states": aux, "input_ids": batch.input_ids, "position_ids": batch.positions, "lengths": lengths}
    out = CollateFn(max_len=-(-T // FLEX_BLOCK) * FLEX_BLOCK, hidden_size=model.hidden_size,
                    num_target_layers=aux.shape[-1] // model.hidden_size, dtype=dtype)([item])
    inputs = {k: out[k].to(aux.device) for k in ("hidden_states", "input_ids", "document_ids", "position_ids")}
    if not bool((inputs["document_ids"][0, :T] == batch.seq_ids).all()):
        raise ValueError("speculators: sequences must be contiguous and numbered 0, 1, ... in the packed batch")
    return inputs


def collate(items: list[dict], hidden_size: int, num_aux: int, multiple: int = 1) -> dict:
    """speculators' own CollateFn with its Eagle-3 shift_batch: pairs (g_t, x_{t+1}, y_{t+1}), padded to a
    multiple of `multiple` rows (its flex attention's block; training pads to total_seq_len)."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    max_len = -(-sum(int(item["lengths"][0]) - 1 for item in items) // multiple) * multiple
    batch = CollateFn(max_len=max_len, hidden_size=hidden_size, num_target_layers=num_aux,
                      dtype=torch.float32, preprocess=shift_batch)(items)
    return {k: batch[k] for k in FORWARD_KEYS}


def loss_config(loss: str):
    from speculators.losses import resolve_loss_config

    return resolve_loss_config(loss, "eager")   # the fused default is a Triton kernel


def draft_vocabulary(response_tokens: torch.Tensor, draft_vocab_size: int, vocab_size: int):
    """(d2t, t2d): the most frequent response tokens (speculators' vocab_mapping.py:80-113)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    tokens, counts = response_tokens.flatten().unique(return_counts=True)
    return build_vocab_mappings_from_distribution(dict(zip(tokens.tolist(), counts.tolist())),
                                                  draft_vocab_size, vocab_size)


def make_draft_model(recipe, target_dir: Path, t2d: torch.Tensor, d2t: torch.Tensor):
    """The draft as speculators' `train` CLI builds it (cli.py:587-592, core.py:368-426): geometry from
    the verifier, default aux ids [2, N//2, N-3], embed/lm_head/verifier head and norm from the target."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.utils import resolve_draft_intermediate_size
    from transformers import AutoConfig, LlamaConfig

    verifier = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    # What speculators.train.cli.create_transformer_layer_config builds for a dense Llama verifier
    # (cli.py:113-286); that module imports pydantic_settings, which is not installed here.
    layer = LlamaConfig(
        vocab_size=verifier.vocab_size, hidden_size=verifier.hidden_size,
        intermediate_size=resolve_draft_intermediate_size(verifier), num_hidden_layers=recipe.draft_layers,
        num_attention_heads=verifier.num_attention_heads, num_key_value_heads=verifier.num_key_value_heads,
        hidden_act=verifier.hidden_act, max_position_embeddings=verifier.max_position_embeddings,
        initializer_range=verifier.initializer_range, rms_norm_eps=verifier.rms_norm_eps,
        head_dim=verifier.head_dim, tie_word_embeddings=False)
    layer.rope_parameters = dict(verifier.rope_parameters)
    with warnings.catch_warnings(), torch.random.fork_rng():
        warnings.simplefilter("ignore")   # "using the default target layer ids": that is the point
        torch.manual_seed(recipe.train_seed)   # HF initialises from the global generator; forked, restored
        return Eagle3DraftModel.from_training_args(
            verifier_config=layer, t2d=t2d, d2t=d2t, target_layer_ids=None,
            verifier_name_or_path=str(target_dir), draft_vocab_size=recipe.draft_vocab_size,
            norm_before_residual=False, ttt_steps=recipe.ttt_steps, draft_attn_impl=recipe.attention)


def train(recipe, model, items: list[dict]) -> list[dict]:
    """AdamW, linearly decayed, on the trainable parameters (speculators freezes embed_tokens and
    lm_head: fc, the decoder layer and the final norm train); returns a
    log of (step, loss, per-step training accuracy) every 50 steps."""
    H = model.hidden_size
    A = len(model.config.eagle_aux_hidden_state_layer_ids)
    losses = loss_config(recipe.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr)
    # Linear decay to zero: the last steps settle instead of jumping between minibatches.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / recipe.optimizer_steps)
    pick = torch.Generator().manual_seed(recipe.train_seed)
    log = []
    model.train()
    for step in range(recipe.optimizer_steps):
        chosen = torch.randint(0, len(items), (recipe.sequences_per_step,), generator=pick).tolist()
        batch = collate([items[i] for i in chosen], H, A)
        _, loss, metrics = model(**batch, ttt_steps=recipe.ttt_steps, ttt_step_loss_decay=recipe.ttt_step_loss_decay,
                                 loss_config=losses)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)   # as speculators' Trainer (trainer.py:551)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step + 1 == recipe.optimizer_steps:
            log.append({"step": step, "loss": round(float(loss), 4), "full_acc": [
                round(float(metrics[f"full_acc_{k}_sum"] / metrics[f"full_acc_{k}_total"]), 3)
                for k in range(recipe.ttt_steps)]})
    model.eval()
    return log


def train_draft(recipe, target, target_dir: Path, train_ids: torch.Tensor) -> dict:
    """The whole build (the `training` capability's entry, as for every trainer): speculators' vocabulary from
    the response tokens, its draft, its training loop on the target's aux states, its save_pretrained config.
    -> {"config": Eagle3Config, "weights": the draft's tensors by canonical name, "log": ..., "draft_vocab":
    target ids of the draft vocabulary}."""
    from conformance.checkpoints import read_config

    vocab = target.model.config.vocab_size
    d2t, t2d = draft_vocabulary(train_ids[:, recipe.prompt_tokens:], recipe.draft_vocab_size, vocab)
    model = make_draft_model(recipe, target_dir, t2d, d2t)
    _, aux, last = target.run(train_ids, tuple(model.config.eagle_aux_hidden_state_layer_ids))
    log = train(recipe, model, speculators_items(train_ids, aux, last))
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        cfg = read_config(Path(saved))
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if not k.startswith("verifier_")}   # the teacher's head and norm are the target's
    return {"config": cfg, "weights": weights, "log": log, "draft_vocab": t2d.nonzero().flatten()}


def heldout_metrics(adapter, ckpt_dir: Path, target_dir: Path, items: list[dict], hidden_size: int, num_aux: int,
                    steps: int, loss: str) -> dict[str, float]:
    """speculators' training forward with its loss and metrics on every item, summed (`full_acc_k_sum`,
    `full_acc_k_total`, `cond_acc_...`).

    The draft loads through `adapter` (the speculators adapter, passed in: it imports this module); the
    teacher (verifier_lm_head = the target's lm_head rows of the draft vocabulary, verifier_norm) through
    speculators' own load_verifier_weights from the target directory, as `from_training_args` does. One
    item per forward: speculators' teacher forcing shifts across packed sequences (core.py:332-338).

    It runs speculators' sdpa path (the draft loads on CPU): the same training forward, loss and metrics over
    the same masks, dense (core.py:53-59, 347-356), for the reason the simulation drafts with it (adapter.py
    `drafter`): eager flex attention spends nearly all its time in vmap overhead, 20.5 s against 2.8 s for the
    64 held-out sequences, every per-row score the same. The flex path is the one the step-0 and multi-step
    tests compare stage by stage, and these scores are compared row by row with the reference's simulation,
    so a difference between the two paths still fails.
    """
    model = adapter.load(ckpt_dir, torch.float32, attention="sdpa").model
    model.config.speculators_config.verifier.name_or_path = str(target_dir)
    model.load_verifier_weights()
    losses = loss_config(loss)
    totals: dict[str, float] = {}
    with torch.no_grad():
        for item in items:
            _, _, metrics = model(**collate([item], hidden_size, num_aux), ttt_steps=steps, loss_config=losses)
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def heldout_scores(adapter, trained, target, steps: int) -> dict:
    """speculators' training forward with its loss and metrics on every held-out sequence of `trained` (the
    acceptance area's TrainedDraft), one sequence per forward (heldout_metrics), and what its metrics scored
    at each start row (scored_starts). -> {"full_acc", "cond_acc": per TTT step, "starts": rows scored at
    step 0, "correct": [sequences, T - 1, steps] drafts 0..k all right at start row t}."""
    cfg = trained.config
    _, aux, last = target.run(trained.heldout_ids, cfg.aux_layer_ids)
    items = speculators_items(trained.heldout_ids, aux, last)
    with scored_starts() as seen:
        totals = heldout_metrics(adapter(), trained.checkpoints[adapter.checkpoint_format], trained.target_dir,
                                 items, cfg.hidden_size, cfg.num_aux_hidden_states, steps, trained.recipe.loss)
    full = [totals[f"full_acc_{k}_sum"] / totals[f"full_acc_{k}_total"] for k in range(steps)]
    cond = [totals[f"cond_acc_{k}_sum"] / totals[f"cond_acc_{k}_total"] for k in range(steps)]
    S, rows = trained.heldout_ids.shape[0], trained.heldout_ids.shape[1] - 1   # shift_batch: T - 1 pairs
    if len(seen) != S * steps:
        raise RuntimeError(f"speculators scored {len(seen)} (sequence, step) pairs, expected {S} x {steps}")
    correct = torch.zeros(S, rows, steps, dtype=torch.bool)
    for i, mask in enumerate(seen):
        correct[i // steps, :mask.numel(), i % steps] = mask
    # The observation must add up to what the metrics reported, step by step.
    observed = [int(correct[:, :, k].sum()) for k in range(steps)]
    reported = [round(totals[f"full_acc_{k}_sum"]) for k in range(steps)]
    if observed != reported:
        raise RuntimeError(f"per-row scores {observed} do not add up to speculators' full_acc sums {reported}")
    return {"full_acc": full, "cond_acc": cond, "starts": int(totals["full_acc_0_total"]), "correct": correct}


@contextlib.contextmanager
def scored_starts():
    """What speculators' metrics score per start row while heldout_metrics runs (observation only).

    Yields a list that gets, per forward and TTT step k in call order, the mask `prev_correct` that
    compute_accuracy_single_step updates in place (metrics.py:52-56): for each start row t < T - k,
    whether drafts 0..k are all right, the per-row terms full_acc_k_sum adds up. The original runs
    unchanged and its counts are returned as they are.
    """
    from speculators.models.eagle3 import metrics

    original = metrics.compute_accuracy_single_step
    seen: list[torch.Tensor] = []

    def observed(pred_ids, target_ids, loss_mask, prev_correct):
        counts = original(pred_ids, target_ids, loss_mask, prev_correct)
        # The real rows, then the padding heldout_metrics adds for flex attention (loss_mask False there).
        real = int(loss_mask.sum()) if loss_mask is not None else prev_correct.numel()
        if loss_mask is not None and not bool(loss_mask.reshape(-1)[:real].all()):
            raise ValueError("scored_starts: a loss mask with False entries; rows would not be starts")
        seen.append(prev_correct.detach().reshape(-1)[:real].clone())
        return counts

    metrics.compute_accuracy_single_step = observed   # compute_metrics looks it up in its module
    try:
        yield seen
    finally:
        metrics.compute_accuracy_single_step = original
