"""NeMo Automodel 0.7.0's saved draft after its own SGLang helper prepared it: the consolidated directory
(formats/nemo.py) with `architectures` rewritten to SGLang's class and nothing else
(speculative/serve_sglang.py:311-321 `_rewrite_config_for_sglang(config_path, config_path, algorithm)`, no
num_hidden_layers: only its legacy draft_model.pt export infers the depth from the tensors, :274-275).

So the file still states the target's depth in num_hidden_layers while it stores the draft's one layer. NeMo
reads it as it reads its own directory (one layer, draft_llama.py:760), and so does this format (read only);
SGLang reads the same file as written and builds num_hidden_layers layers (conformance/user/readings.py shows
both readings). Detected by what only NeMo's recipe writes (its `parallel_drafting` key, train_eagle3.py:648)
and its draft's `model.`-prefixed tensors, with fewer layers stored than the file states; a renamed directory
whose depth was rewritten to the stored layers is plain SGLang format.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.formats import nemo, sglang
from conformance.checkpoints.knobs import ParsedConfig

NAME = "nemo-sglang"
NEMO_KEY, PREFIX = "parallel_drafting", "model."


def detected(raw: dict, tensor_names: list[str]) -> bool:
    """NeMo's saved layout under SGLang's class name, its num_hidden_layers still the target's depth."""
    drafted = [n for n in tensor_names if n not in nemo.UNPREFIXED]
    if raw.get("architectures", [None])[0] != sglang.ARCHITECTURE or NEMO_KEY not in raw or not drafted \
            or not all(n.startswith(PREFIX) for n in drafted):
        return False
    stored = {n.split(".")[2] for n in drafted if n.startswith(PREFIX + "layers.") and n.count(".") > 2}
    depth = raw.get("num_hidden_layers")
    return isinstance(depth, int) and not isinstance(depth, bool) and depth > len(stored)


def parse(raw: dict, file: Path) -> ParsedConfig:
    return nemo.parse(raw, file, NAME)


def stored_name(name: str) -> str:
    return nemo.stored_name(name)
