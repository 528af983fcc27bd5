"""Checkpoints and user inputs: every draft format read into one Eagle3Config (training semantics) and
tensors under canonical names, written back and converted; target configs; training data and
hidden-state dumps. Every problem with a file is one CheckpointError line naming the file and field.

    errors.py          CheckpointError / ConversionError, the typed JSON reader
    schema.py          the tensor schema (names, shapes, kinds per config) and canonical names
    weights.py         weight files: headers, read_weights, save_weights, sha256
    knobs.py           ParsedConfig and the decoder-layer / RoPE knobs every format shares
    formats/           one module per format (speculators, sglang, sglang_legacy, specforge, eagle, nemo),
                       detection and dispatch
    directory.py       a draft directory: open_checkpoint, write_draft, convert
    targets.py         a target model's config.json
    training_data.py   the JSONL samples and the packed batch a draft sees
    hidden_states.py   speculators' hidden-state dumps and the tiny random target
"""
from conformance.checkpoints.directory import (DraftCheckpoint, convert, detect_format, open_checkpoint, read_config,
                                               read_config_file, save_stored, write_draft)
from conformance.checkpoints.errors import CheckpointError, ConversionError, load_json
from conformance.checkpoints.formats import FORMATS, WRITABLE, config_format, config_json, from_canonical, parse_config
from conformance.checkpoints.knobs import CONFIG_FILE, ParsedConfig
from conformance.checkpoints.schema import expected_tensors, needed_by, to_canonical, undeclared_tensors
from conformance.checkpoints.targets import read_target_config
from conformance.checkpoints.weights import (BIN_FILE, INDEX_FILE, WEIGHTS_FILE, TensorInfo, read_tensor, read_weights,
                                             save_weights, sha256, tensor_index, weight_files)

__all__ = [
    "BIN_FILE", "CONFIG_FILE", "FORMATS", "INDEX_FILE", "WEIGHTS_FILE", "WRITABLE",
    "CheckpointError", "ConversionError", "DraftCheckpoint", "ParsedConfig", "TensorInfo",
    "config_format", "config_json", "convert", "detect_format", "expected_tensors", "from_canonical", "load_json",
    "needed_by", "open_checkpoint", "parse_config", "read_config", "read_config_file", "read_target_config",
    "read_tensor", "read_weights", "save_stored", "save_weights", "sha256", "tensor_index", "to_canonical",
    "undeclared_tensors", "weight_files", "write_draft",
]
