"""Training data as draft inputs: the JSONL schema and its errors, the hidden-state dump layout, the
tiny target's aux states, and the (g_t, x_{t+1}) alignment of the packed batch.
"""
from __future__ import annotations

import json

import pytest
import torch

from conformance.checkpoints import CheckpointError
from fixtures.tiny import make_config
from conformance.checkpoints.hidden_states import TinyTarget, read_dump, write_dump
from conformance.checkpoints.training_data import (MAX_TOKENS, first_samples, load_samples, make_data_batch,
                                                   write_samples)

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CFG = make_config(hidden_size=40, target_hidden_size=40)
LINE = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "seq_len": 4, "n_prompt_tokens": 2,
        "n_response_tokens": 2, "source": "chat"}


def write_lines(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_valid_samples_load(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", LINE, {**LINE, "loss_mask": [False, False, True, True]}, "")
    samples = load_samples(path, vocab_size=97)
    assert [s.line for s in samples] == [1, 2] and samples[0].input_ids == (5, 6, 7, 8)


@pytest.mark.parametrize("row,words", [
    ({k: v for k, v in LINE.items() if k != "input_ids"} | {"token_ids": [1, 2]},
     "line 1: missing field input_ids (found: loss_mask, seq_len, n_prompt_tokens, n_response_tokens, source, "
     "token_ids)"),
    ({**LINE, "seq_len": 5}, "line 1: seq_len: 5, but input_ids has 4 tokens"),
    ({**LINE, "loss_mask": [0, 1, 1, 1]}, "line 1: loss_mask: is 1 inside the prompt"),
    ({**LINE, "loss_mask": [0, 0, 1, 0]}, "line 1: loss_mask: does not cover the response"),
    ({**LINE, "loss_mask": [0, 0, 1]}, "line 1: loss_mask: has 3 entries, but seq_len is 4"),
    ({**LINE, "loss_mask": [0, 0, 2, 1]}, "line 1: loss_mask: expected only 0 and 1, got 2"),
    ({**LINE, "n_response_tokens": 3},
     "line 1: n_response_tokens: n_prompt_tokens 2 + n_response_tokens 3 != seq_len 4"),
    ({**LINE, "input_ids": [5, 6, 7, 200]}, "line 1: input_ids: token id 200 >= the draft's vocab_size 97"),
    ({**LINE, "input_ids": "5 6 7 8"}, "line 1: input_ids: expected a list of integers"),
    ({**LINE, "source": 3}, "line 1: source: expected a string"),
    ({**LINE, "seq_len": "4"}, "line 1: seq_len: expected a non-negative integer"),
    ('{"input_ids": [1, 2', "line 1: not valid JSON"),
    ("[1, 2, 3]", "line 1: expected a JSON object, got list"),
])
def test_malformed_line_is_named(row, words, tmp_path):
    path = write_lines(tmp_path / "d.jsonl", row)
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        load_samples(path, vocab_size=97)
    message = str(info.value)
    assert message.startswith(str(path)) and words in message and "\n" not in message, message
    assert path.read_bytes() == before


def test_the_first_bad_line_is_the_one_named(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", LINE, LINE, {**LINE, "seq_len": 9})
    with pytest.raises(CheckpointError, match="line 3: seq_len"):
        load_samples(path)


def test_empty_file_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n\n")
    with pytest.raises(CheckpointError, match="empty file"):
        load_samples(tmp_path / "d.jsonl")


def test_tiny_target_aux_states_are_hf_hidden_states():
    """hidden_states[i] of transformers' own forward: the input of layer i (0 = embeddings), aux ids in
    training convention, then the last; [L, A+1, Ht] as speculators' datagen stores it."""
    target = TinyTarget(CFG, torch.Generator().manual_seed(0))
    ids = [3, 9, 27, 81, 42]
    hs = target.hidden_states(ids)
    assert hs.shape == (5, 4, CFG.target_hidden_size)
    with torch.no_grad():
        ref = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(CFG.aux_layer_ids):
        assert torch.equal(hs[:, j], ref[layer][0])
    emb = target.model.model.embed_tokens.weight[ids]
    assert not torch.equal(hs[:, 0], emb), "aux id 2 must not be the embedding"
    again = TinyTarget(CFG, torch.Generator().manual_seed(0)).hidden_states(ids)
    assert torch.equal(hs, again), "the tiny target is not deterministic"


def test_dump_round_trip_and_alignment(tmp_path):
    ids = [[1, 2, 3, 4, 5], [6, 7, 8]]
    data = write_samples(tmp_path / "d.jsonl", ids, n_prompt=[2, 1])
    samples = load_samples(data, CFG.vocab_size)
    target = TinyTarget(CFG, torch.Generator().manual_seed(0))
    full = [target.hidden_states(list(s.input_ids)) for s in samples]
    dump = write_dump(tmp_path / "hs", samples, full)
    assert sorted(p.name for p in dump.iterdir()) == ["hs_0.safetensors", "hs_1.safetensors"]
    aux = read_dump(dump, samples, CFG)
    assert [a.shape for a in aux] == [(4, 3 * CFG.target_hidden_size), (2, 3 * CFG.target_hidden_size)]
    assert torch.equal(aux[0][1], full[0][1, :3].flatten().double())     # g_1: the aux layers of token 1
    batch = make_data_batch(CFG, samples, aux, steps=2)
    # pair t is (g_t, x_{t+1}) (speculators shift_batch, data.py:28-29), positions from 0 per sequence
    assert batch.input_ids.tolist() == [2, 3, 4, 5, 7, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1] and batch.seq_ids.tolist() == [0, 0, 0, 0, 1, 1]
    assert batch.next_ids[:, 0].tolist() == [3, 4, 5, 7, 8, 0]    # speculators' shift over the packed row


@pytest.mark.parametrize("edit,words", [
    (lambda d: (d / "hs_1.safetensors").unlink(),
     "hs_1.safetensors: file: missing: the hidden states of training-data line 2"),
    (lambda d: (d / "hs_0.safetensors").write_bytes(b"\x00" * 9),
     "hs_0.safetensors: file: not a readable safetensors file"),
], ids=["missing_file", "corrupt_file"])
def test_broken_dump_is_named(edit, words, tmp_path):
    samples = load_samples(write_samples(tmp_path / "d.jsonl", [[1, 2, 3], [4, 5, 6]], n_prompt=[1, 1]), 97)
    target = TinyTarget(CFG, torch.Generator().manual_seed(0))
    dump = write_dump(tmp_path / "hs", samples, [target.hidden_states(list(s.input_ids)) for s in samples])
    edit(dump)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(")):
        read_dump(dump, samples, CFG)


def test_long_samples_are_cut_for_the_batch():
    from conformance.checkpoints.training_data import Sample
    long = Sample(1, tuple(range(100)), (0,) * 10 + (1,) * 90, 10, "x")
    cut = first_samples([long] * 9)
    assert len(cut) == 4 and len(cut[0].input_ids) == MAX_TOKENS + 1
