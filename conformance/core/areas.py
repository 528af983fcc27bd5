"""The check areas, each declared once: what its registry entries name, what their conditions read, what it
observes, how an observation matches an entry, and how a finding reads in the report, the support matrix and
the verdict. registry.py, matching.py, the support matrix and the verdict read this table; none of them
branches on an area's name.

An observation is what one check saw (a first divergence, a loader's refusal, a wiring mismatch, an
accounting's problems, a resolved server setting). `Area.match` returns the entries that are EXACTLY that
observation (its place and its signature) and what no entry explains: a different failure is never hidden.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from conformance.core.findings import FORWARD, LOADING, READING, SETTINGS, WIRING
from conformance.core.stages import TREE, TREE_FINAL, stage_names
from reference.eagle3 import Eagle3Config


class Entry(Protocol):
    """What an area reads of a registry entry (registry.Known)."""

    area: str
    id: str
    step: int | None
    stage: str | None
    error: str | None
    message: str | None
    kind: str | None
    problem: str | None
    tensors: tuple[str, ...]
    setting: str | None
    key: str | None
    reads: str | None
    source: str | None
    asserted: bool
    round: int | None
    rows: str | None


# ---------------------------------------------------------------- observations

@dataclass(frozen=True)
class Divergence:
    """A forward comparison's first divergent step and stage (None: it conformed)."""

    first: object | None     # compare.StageResult: .step, .stage
    num_layers: int


@dataclass(frozen=True)
class Refusal:
    """An implementation's loader refused the draft: its exception class (None: not kept) and its message."""

    error: str | None
    message: str


@dataclass(frozen=True)
class Mismatch:
    """The kind of slot mismatch between the layers a server feeds and those training used; for a server that
    raised (ERROR_KINDS), the class of its exception (None: not observed) and its one-line message."""

    kind: str
    error: str | None = None
    message: str = ""


@dataclass(frozen=True)
class AccountingProblems:
    """(problem, tensor or message) for every problem of a weight accounting; "refused" for a refusal."""

    problems: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Setting:
    """A resolved server setting the draft is served with differently from training."""

    setting: str


@dataclass(frozen=True)
class Reading:
    """What one implementation took a config key to mean, read off its loaded model (lm_head, a knob)."""

    key: str
    reads: str


@dataclass(frozen=True)
class ServedDivergence:
    """One request a serving engine served, against the reference (conformance/engine/check.py): its first
    divergent round, draft step and stage (None: every round conformed), and which rows of that pass differ, as
    the engine lane names them (ROW_SIGNATURES; "other" when none fits)."""

    place: tuple[int, int, str] | None
    rows: str = "other"


@dataclass
class Match:
    """The entries an observation is exactly, and what none of them explains."""

    hits: list = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)

    @property
    def explained(self) -> bool:
        """Every part of the observation is a registered behaviour (and there was something to explain)."""
        return bool(self.hits) and not self.unexplained


# ---------------------------------------------------------------- the areas

KNOBS = frozenset(f.name for f in dataclasses.fields(Eagle3Config))
SERVER_FLAGS = ("speculative_draft_window_size",)   # the server flags a draft case may carry
SERVER_SETTINGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                   "speculative_algorithm", "speculative_token_map", "speculative_draft_window_size",
                   "speculative_draft_sink_size", "speculative_use_rejection_sampling",
                   "speculative_accept_threshold_single", "speculative_accept_threshold_acc", "max_running_requests")
WIRING_KINDS = ("config refused", "capture failed", "default list", "slot missing", "one layer shallower",
                "one layer deeper", "wrong layers")
ERROR_KINDS = WIRING_KINDS[:2]   # the server raised: an entry of these kinds names the exception and its message
ACCOUNTING_PROBLEMS = {"dropped silently": "dropped", "never loaded": "never_loaded",
                       "differs from checkpoint": "differs", "NaN/inf after loading": "nan"}   # -> Accounting field
SETTING_NAMES = frozenset(SERVER_SETTINGS) | {"embed_tokens", "lm_head"}
# A settings entry no check of this suite shows through the implementation's own code (`asserted = true`): its
# condition alone flags it, and the support matrix and the verdict say so.
ASSERTED = "asserted, not observed"
DRAFT_NAMES = KNOBS | frozenset(SERVER_FLAGS)
# A reading is of the file as written: its format, the DEFAULTED keys it leaves out, the keys training overrules.
READING_NAMES = KNOBS | {"format", "absent", "overruled"}
READING_SOURCES = ("observed", "read from code")   # code: its implementation cannot run where the suite is built
WIRING_NAMES = frozenset({"target", "target_class", "format", "case", "trainer", "num_layers", "trained_on_default",
                          "config_has_ids", "first_config_id", "min_config_id", "max_config_id", "config_shift",
                          "runner"})   # runner: a server with more than one model runner (vLLM: "v1", "v2"); else None
# A served scenario, as an engine entry's condition reads it: the draft tokens per round, prefill chunks (a chunk size
# was set), prefix caching, the draft's format and layers, the model runner.
ENGINE_NAMES = frozenset({"K", "chunked_prefill", "prefix_caching", "format", "layers", "runner"})
# The rows of a served pass the engine lane recognises by what they hold (conformance/engine/served_lane.py
# `row_signature`): an engine entry names one, and matches only a divergence at exactly those rows.
ROW_SIGNATURES = ("partial chunk ends embed the prompt's last token",)


def deciding(known: Sequence[Entry], num_layers: int) -> Entry | None:
    """The entry that decides a forward comparison: a load entry first, else the earliest (step, stage)."""
    if not known:
        return None
    order = {name: i for i, name in enumerate(stage_names(num_layers) + TREE + TREE_FINAL)}
    return min(known, key=lambda e: (-1, -1) if e.area == LOAD else (e.step, order.get(e.stage, len(order))))


def _match_forward(known: Sequence[Entry], seen: Divergence) -> Match:
    # A forward comparison is decided by one entry (the load entries of the same case come first: a draft
    # that is refused never runs); it is a hit only at that entry's exact step and stage.
    entry = deciding(known, seen.num_layers)
    if seen.first is None:
        return Match()
    where = f"step {seen.first.step} `{seen.first.stage}`"
    if entry is not None and entry.area != LOAD and (seen.first.step, seen.first.stage) == (entry.step, entry.stage):
        return Match([entry])
    return Match(unexplained=[where])


def _match_load(known: Sequence[Entry], seen: Refusal) -> Match:
    hit = next((e for e in known if e.area == LOAD and (seen.error is None or seen.error == e.error)
                and re.search(e.message, seen.message)), None)
    return Match([hit]) if hit else Match(unexplained=[f"refused: {seen.message}"])


def _match_wiring(known: Sequence[Entry], seen: Mismatch) -> Match:
    # The first applicable entry decides (entries of one place are ordered most specific first in the file); an
    # entry of an error kind only with its exception class and a message its pattern is found in.
    wiring = [e for e in known if e.area == "wiring"]
    entry = wiring[0] if wiring else None
    if entry is not None and entry.kind == seen.kind and (entry.error is None or (
            seen.error == entry.error and re.search(entry.message, seen.message))):
        return Match([entry])
    return Match(unexplained=[f"{seen.kind}: {seen.message}" if seen.message else seen.kind])


def _match_accounting(known: Sequence[Entry], seen: AccountingProblems) -> Match:
    # A refusal is explained by a load entry whose pattern its message has; any other problem by an
    # accounting entry of that problem whose tensor patterns include the tensor.
    out = Match()
    for problem, what in seen.problems:
        if problem == "refused":
            hits = _match_load(known, Refusal(None, what)).hits
        else:
            hits = [e for e in known if e.area == "accounting" and e.problem == problem
                    and any(re.fullmatch(t, what) for t in e.tensors)][:1]
        if not hits:
            out.unexplained.append(f"{problem}: {what}")
        elif hits[0] not in out.hits:
            out.hits.append(hits[0])
    return out


def _match_setting(known: Sequence[Entry], seen: Setting) -> Match:
    hits = [e for e in known if e.area == "settings" and e.setting == seen.setting]
    return Match(hits) if hits else Match(unexplained=[seen.setting])


def _match_reading(known: Sequence[Entry], seen: Reading) -> Match:
    hits = [e for e in known if e.area == "reading" and (e.key, e.reads) == (seen.key, seen.reads)]
    return Match(hits[:1]) if hits else Match(unexplained=[f"reads {seen.key} as {seen.reads}"])


def _match_engine(known: Sequence[Entry], seen: ServedDivergence) -> Match:
    # A served request is a hit only at an entry's exact round, step and stage, with exactly its rows.
    if seen.place is None:
        return Match()
    hits = [e for e in known if e.area == ENGINE and (e.round, e.step, e.stage, e.rows) == (*seen.place, seen.rows)]
    r, step, stage = seen.place
    return Match(hits[:1]) if hits else Match(unexplained=[f"round {r}, step {step} `{stage}` ({seen.rows})"])


def _stage_ok(extra: tuple[str, ...] = ()) -> Callable[[str], bool]:
    stages = frozenset(stage_names(4)) | set(extra)
    return stages.__contains__


def _check_draft(item: Mapping, stage_ok: Callable[[str], bool]) -> tuple[str, str] | None:
    if not (isinstance(item.get("step"), int) and item["step"] >= 0):
        return "step", f"{item.get('step')!r} is not a step (an integer >= 0)"
    if isinstance(item.get("stage"), str) and not stage_ok(item["stage"]):
        return "stage", f"{item['stage']!r} is not a canonical stage of its area"
    return None


def _one_of(field_name: str, allowed) -> Callable[[Mapping], tuple[str, str] | None]:
    def check(item: Mapping) -> tuple[str, str] | None:
        if item.get(field_name) not in allowed:
            return field_name, f"{item.get(field_name)!r} is not one of {sorted(allowed)}"
        return None
    return check


def _check_load(item: Mapping) -> tuple[str, str] | None:
    if isinstance(item.get("error"), str) and not item["error"].isidentifier():
        return "error", f"{item['error']!r} is not an exception class name"
    return None


def _check_reading(item: Mapping) -> tuple[str, str] | None:
    if "source" in item and (problem := _one_of("source", READING_SOURCES)(item)):
        return problem
    if "step" in item or "stage" in item:
        return _check_draft(item, _stage_ok())
    return _check_load(item)


def _check_wiring(item: Mapping) -> tuple[str, str] | None:
    if problem := _one_of("kind", WIRING_KINDS)(item):
        return problem
    raised = item["kind"] in ERROR_KINDS
    for name in ("error", "message"):
        if (name in item) != raised:
            return name, (f"a {item['kind']!r} entry names the exception its server raises (error, message)" if raised
                          else f"only an entry of an error kind {list(ERROR_KINDS)} names an exception")
    return _check_load(item)


def _check_setting(item: Mapping) -> tuple[str, str] | None:
    if problem := _one_of("setting", SETTING_NAMES)(item):
        return problem
    if "asserted" in item and not (item["asserted"] is True and "shown_by" not in item):
        return "asserted", f"{item['asserted']!r}: only `true`, on an entry no comparison shows (no shown_by)"
    return None


def _check_tensors(item: Mapping) -> tuple[str, str] | None:
    problem = _one_of("problem", ACCOUNTING_PROBLEMS)(item)
    value = item.get("tensors")
    if problem is None and not (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
        return "tensors", f"{value!r} is not a non-empty list of tensor-name patterns"
    return problem


def _check_engine(item: Mapping) -> tuple[str, str] | None:
    if not (isinstance(item.get("round"), int) and item["round"] >= 0):
        return "round", f"{item.get('round')!r} is not a round (an integer >= 0)"
    return _check_draft(item, _stage_ok()) or _one_of("rows", ROW_SIGNATURES)(item)


@dataclass(frozen=True)
class Area:
    name: str
    signature: tuple[str, ...]          # the registry fields that name its exact place and observed signature
    names: frozenset[str]               # what its entries' `when` conditions read
    observes: type                      # what one of its checks sees (an observation class above)
    match: Callable[[Sequence[Entry], object], Match]   # the entries an observation is exactly
    place: Callable[[Entry], str]       # an entry's place, as the report, the verdict and a strict xfail show it
    cell: Callable[[Entry], str]        # an entry in the support matrix
    rank: int                           # where its problems come in the verdict (conformance/core/findings.py)
    validate: Callable[[Mapping], tuple[str, str] | None] = lambda item: None   # (field, why) of a bad entry
    optional: tuple[str, ...] = ()      # registry fields it may have besides its signature
    # Its entries are of a serving engine, whose version is the one its adapter's engine runs (an engine in an
    # environment of its own, e.g. vLLM's CPU build, has its own); else the implementation's installed version.
    engine: bool = False

    def judge(self, known: Sequence[Entry], seen: object) -> Match:
        """The entries of this area (and of the areas it is decided with) that `seen` is exactly."""
        if not isinstance(seen, self.observes):
            raise TypeError(f"area {self.name}: observes {self.observes.__name__}, not {type(seen).__name__}")
        return self.match(known, seen)


LOAD = "load"
ENGINE = "engine"
_STEP_STAGE = ("step", "stage")


def _diverges(e: Entry) -> str:
    return f"diverges: step {e.step} `{e.stage}` ({e.id})"


AREAS: dict[str, Area] = {a.name: a for a in (
    Area("draft", _STEP_STAGE, DRAFT_NAMES, Divergence, _match_forward,
         place=lambda e: f"step {e.step} `{e.stage}`", cell=_diverges, rank=FORWARD,
         validate=lambda item: _check_draft(item, _stage_ok()), optional=("neutral", "neutral_weights")),
    Area("tree", _STEP_STAGE, KNOBS | {"topk", "steps", "num_draft_tokens"}, Divergence, _match_forward,
         place=lambda e: f"step {e.step} `{e.stage}`", cell=_diverges, rank=FORWARD,
         validate=lambda item: _check_draft(item, _stage_ok(TREE + TREE_FINAL))),
    Area(LOAD, ("error", "message"), DRAFT_NAMES, Refusal, _match_load,
         place=lambda e: f"load refused: {e.error} /{e.message}/",
         cell=lambda e: f"refused at load: {e.error} ({e.id})", rank=LOADING, validate=_check_load,
         optional=("neutral",)),
    Area("wiring", ("kind",), WIRING_NAMES, Mismatch, _match_wiring,
         place=lambda e: str(e.kind) + (f": {e.error} /{e.message}/" if e.error else ""),
         cell=lambda e: f"{e.kind} ({e.id})", rank=WIRING, validate=_check_wiring, optional=("error", "message")),
    Area("accounting", ("problem", "tensors"), DRAFT_NAMES, AccountingProblems, _match_accounting,
         place=lambda e: f"{e.problem}: {', '.join(e.tensors)}",
         cell=lambda e: f"weight accounting: {e.problem} ({e.id})", rank=LOADING, validate=_check_tensors),
    Area("settings", ("setting",), KNOBS | frozenset(SERVER_SETTINGS) | {"config_has_draft_vocab_size"}, Setting,
         _match_setting, place=lambda e: str(e.setting),
         cell=lambda e: f"served differently: {e.setting} ({e.id}" + (f", {ASSERTED})" if e.asserted else ")"),
         rank=SETTINGS, validate=_check_setting, optional=("shown_by", "asserted")),
    Area("reading", ("key", "reads"), READING_NAMES, Reading, _match_reading,
         place=lambda e: f"reads {e.key} as {e.reads}",
         cell=lambda e: f"reads {e.key} as {e.reads} ({e.source or 'observed'}; {e.id})", rank=READING,
         validate=_check_reading, optional=("fix", "source", "step", "stage", "error", "message")),
    Area(ENGINE, ("round", "step", "stage", "rows"), ENGINE_NAMES, ServedDivergence, _match_engine,
         place=lambda e: f"round {e.round}, step {e.step} `{e.stage}` ({e.rows})",
         cell=lambda e: f"served: round {e.round}, step {e.step} `{e.stage}` ({e.id})", rank=FORWARD,
         validate=_check_engine, engine=True),
)}
