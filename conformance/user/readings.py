"""One file, one reading: what each implementation takes a key of the user's config.json to mean, read off the
model it loaded (its weight accounting: where the stored lm_head landed, the residual its layer 0 adds, its
window), against training's (the reference on the same file). Where an implementation reads a key otherwise
and a `reading` entry of the registry (conformance/core/registry.toml) is exactly that reading, the verdict
has a problem naming every implementation's reading, each entry's file:line, and the key to write so that
they agree.
"""
from __future__ import annotations

import dataclasses
import re

from conformance.adapters import REFERENCE
from conformance.checkpoints.knobs import CONFIG_FILE
from conformance.core import registry
from conformance.core.areas import Reading
from conformance.core.findings import CONVERT, READING, Problem
from conformance.core.matching import judge
from conformance.user.problems import UNKNOWN_FIX

NOT_OBSERVED = "not observed"
# A reading whose fix names this suite's converter (it writes every key in training's reading): the verdict prints
# the conversion and the check of it (conformance/user/commands.py fix_commands).
CONVERTER = "conformance.user.convert"


def lm_head(acct) -> str:
    """The head an implementation computes the draft's logits with: the stored lm_head.weight (landed in its
    lm_head), its embed_tokens (tied), or the target's."""
    if any(name == "lm_head.weight" and where.startswith(("lm_head", "model.lm_head")) for name, where in acct.landed):
        return "lm_head.weight"
    use = acct.uses.get("lm_head", "")
    return "embed_tokens" if use.startswith("embed_tokens") else "the target's lm_head" if "target" in use \
        else f"{NOT_OBSERVED}: {acct.refused or use or 'no lm_head'}"


def _knob(name: str):
    def read(acct) -> str:
        value = acct.knobs.get(name, f"{NOT_OBSERVED}: {acct.refused or 'no ' + name}")
        return str(value).lower() if isinstance(value, (bool, int)) or value == "none" else str(value)
    return read


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
STORED_LAYERS = "the layers stored"
STATED_LAYERS = "num_hidden_layers layers, the unstored ones never loaded"


def _layers(acct) -> tuple[list[int], list[int]]:
    """(the decoder layers the loaded model has, those a checkpoint tensor reached), by its parameters' names."""
    loaded = {int(m[1]) for _, where in acct.landed if (m := _LAYER.search(where))}
    built = loaded | {int(m[1]) for name in acct.never_loaded if (m := _LAYER.search(name))}
    return sorted(built), sorted(loaded)


def layers(acct) -> str:
    """How many decoder layers an implementation builds for num_hidden_layers: the layers the file stores, or
    num_hidden_layers of them with those the file does not store never loaded (its weight accounting)."""
    built, loaded = _layers(acct)
    if acct.refused or not built:
        return f"{NOT_OBSERVED}: {acct.refused or 'no decoder layer'}"
    return STORED_LAYERS if built == loaded else STATED_LAYERS


def layers_seen(acct) -> str:
    """The numbers behind `layers`: built, loaded, and the layers never loaded."""
    built, loaded = _layers(acct)
    unloaded = [i for i in built if i not in loaded]
    span = (f"layers.{unloaded[0]}" + (f"-{unloaded[-1]}" if len(unloaded) > 1 else "")) if unloaded else ""
    return f"{len(built)} built, {len(loaded)} loaded" + (f", {span} never loaded" if span else "") if built else ""


# Per config key: what it decides in the loaded model, read off an Accounting (loading/accounting.py).
OBSERVE = {"tie_word_embeddings": lm_head,
           "norm_before_residual": _knob("norm_before_residual"),   # observed by running layer 0
           "sliding_window": _knob("sliding window"),
           "num_hidden_layers": layers}                              # observed in its weight accounting
# Per key, the numbers an observation stands for, shown beside it (the reading itself is what a registry entry
# matches: the same words for every depth).
SEEN = {"num_hidden_layers": layers_seen}


def names(ckpt) -> dict[str, object]:
    """What a reading condition reads of a DraftCheckpoint: the knobs in training semantics, the file's format,
    the DEFAULTED keys it leaves out and the keys whose stated value training overrules."""
    return {**dataclasses.asdict(ckpt.config), "format": ckpt.format, "absent": ckpt.parsed.absent,
            "overruled": tuple(ckpt.parsed.overruled)}


def observe(acct, key: str) -> str:
    return OBSERVE[key](acct) if key in OBSERVE else NOT_OBSERVED


def reading_problems(store, accounts: dict) -> list[Problem]:
    """One problem per key that an implementation reads otherwise than training, exactly as a registered
    reading says (`accounts`: per implementation, on the directory it loads; the reference's is training's)."""
    given = names(store.inputs.checkpoint)
    known = {impl: registry.applicable("reading", impl, given) for impl in accounts if impl != REFERENCE}
    out = []
    for key in dict.fromkeys(e.key for entries in known.values() for e in entries if e.key in OBSERVE):
        readings = {impl: observe(acct, key) for impl, acct in accounts.items()}
        trained = readings[REFERENCE]
        hits = {impl: judge("reading", [e for e in entries if e.key == key], Reading(key, readings[impl])).hits
                for impl, entries in known.items()}
        departs = [impl for impl, hit in hits.items() if hit and readings[impl] != trained]
        if not departs:
            continue
        seen = {impl: SEEN[key](acct) if key in SEEN else "" for impl, acct in accounts.items()}
        out.append(_problem(store, key, readings, hits, departs, seen))
    return out


def _problem(store, key: str, readings: dict[str, str], hits: dict, departs: list[str],
             seen: dict[str, str]) -> Problem:
    parsed = store.inputs.checkpoint.parsed
    stated = ("true as written, which training overrules" if key in parsed.overruled else
              "absent: each implementation's default" if key in parsed.absent else "as written")

    def who(impl: str) -> str:
        version = registry.installed_version(impl) if impl != REFERENCE else None
        return "training (the reference)" if impl == REFERENCE else f"{impl} {version}"

    def how(impl: str) -> str:
        copy = "" if impl == REFERENCE or store.as_written(impl) else ", of this suite's conversion to its format"
        numbers = f"{seen[impl]}; " if seen.get(impl) else ""
        return f"{who(impl)}: {readings[impl]} ({numbers}observed on its loaded model{copy})"

    entries = [e for impl in readings if impl in hits for e in hits[impl]]
    fix = next((e.fix for impl in departs for e in hits[impl] if e.fix), None) or UNKNOWN_FIX
    first = hits[departs[0]][0]
    return Problem(f"{', '.join(who(i) for i in departs)} read{'s' if len(departs) == 1 else ''} {CONFIG_FILE}'s "
                   f"{key} otherwise than training ({first.id})", f"{CONFIG_FILE}: {key} ({stated})",
                   "; ".join(how(impl) for impl in readings),
                   " ".join(f"{e.impl} ({e.id}): {e.reason}" for e in entries), fix, READING,
                   key=f"reading:{key}", known=first.id, impl=departs[0],
                   remedy=CONVERT if CONVERTER in fix else "")
