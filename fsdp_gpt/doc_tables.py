"""The docs' lists written once: what README.md and docs/ say of the model families (FAMILIES), the
config keys (config.py's fields, model_keys.py's rule) and the TensorBoard tags (each owner's TAGS) is
made from them here.

A generated part of a page sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->` (NAME a
key of PARTS); `python -m fsdp_gpt.doc_tables` rewrites every such part in place, and
tests/test_docs.py fails while a page holds one that differs from what it would write. A new family,
key or tag then reaches every page that lists them without a hand edit.
"""
import glob
import os
import re
import sys

from fsdp_gpt.config_help import keys_markdown
from fsdp_gpt.data.loader import BatchLoader
from fsdp_gpt.families import FAMILIES, FAMILY_KEYS
from fsdp_gpt.family_parts import ALL_BIASES, Family
from fsdp_gpt.model_keys import DEFINING_KEYS, MODEL_FIELDS
from fsdp_gpt.observe.metrics import ProgressLog
from fsdp_gpt.optim.expert_balance import ExpertBalance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the model families ----

# an entry's layout in words, field by field (a value missing here shows as it is written in the entry)
NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "rmsnorm_offset": "RMSNorm of (1 + weight)"}
NORM_PLACES = {"before": "before each sublayer", "after": "after each sublayer (before the residual add)",
               "both": "before and after each sublayer"}
POSITIONS = {"learned": "learned positions", "rope": "RoPE"}
MLPS = {"gelu": "tanh-GELU MLP", "swiglu": "SwiGLU", "geglu": "GeGLU", "relu2": "ReLU² MLP",
        "clamped_swiglu": "clamped SwiGLU (gpt-oss's)"}
QK_NORM_SCOPES = {"head": "per head", "projection": "over their whole projections"}
ATTENTIONS = {"latent": "multi-head latent attention"}  # multi-head (grouped-query) attention goes unsaid


def _word(words: dict, value) -> str:
    return words.get(value, f"`{value}`")


def layout(family: Family) -> str:
    """The layout an entry builds where its keys are at their defaults, in words (model.py reads each
    field in one place); a refinement's `when` keys, which the arch column names, add to it."""
    positions = _word(POSITIONS, family.positions)
    if family.partial_rotary != 1.0:
        positions += f" on the first {family.partial_rotary:g} of each head"
    if family.rope_pattern != ("rope",):
        positions += f" by layer: `[{', '.join(family.rope_pattern)}]`, repeated"
    parts = [f"{_word(NORMS, family.norm)} {_word(NORM_PLACES, family.norms)}"]
    if family.attn_pattern != ("full",):
        parts.append(f"layers by `[{', '.join(family.attn_pattern)}]`, repeated (linear: Gated DeltaNet)")
    if family.attn_gate:
        parts.append("attention's output gated (a sigmoid of its own rows of `c_attn`)")
    parts.append(positions)
    if family.attention != "mha":
        parts.append(_word(ATTENTIONS, family.attention))
    parts.append(_word(MLPS, family.mlp))
    if family.moe_score != "softmax":  # where moe_experts is set
        parts.append(f"experts scored by {family.moe_score}")
    if family.shared_expert_gate:
        parts.append("the shared experts' output gated (a sigmoid of one linear of x)")
    if family.qk_norm:
        parts.append(f"q and k normalised {_word(QK_NORM_SCOPES, family.qk_norm_scope)}")
    if family.embed_scale:
        parts.append("embeddings times sqrt(`n_embd`)")
    if family.sinks:
        parts.append("an attention sink per head")
    parts.append("biases on every linear" if set(family.biases) == set(ALL_BIASES) else
                 f"biases on {', '.join(f'`{b}`' for b in family.biases)}" if family.biases else "no biases")
    parts.append("tied head" if family.tied else "untied head")
    return "; ".join(parts)


def families_table() -> str:
    """docs/families.md's table: every family in its entry's words."""
    everyone = [key for key in FAMILIES[0].resumable if all(key in f.resumable for f in FAMILIES)]
    rows = ["| family | `arch` | layout | Hugging Face class | a resume may also change |",
            "| --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        arch = f"`{f.arch}`" + (f" with {', '.join(f'`{key}`' for key in f.when)} set" if f.when else "")
        resumable = ", ".join(f"`{key}`" for key in f.resumable if key not in everyone) or "nothing more"
        inside = "".join(f"; the language model of `{wrapper}`" for wrapper in f.hf_wrappers)
        rows.append(f"| {f.name} | {arch} | {layout(f)} | `{f.hf_class}`{inside} | {resumable} |")
    return "\n".join(rows + ["", f"Every family's resume may change {' and '.join(f'`{k}`' for k in everyone)} "
                                  f"(they hold no weights)."])


def family_keys_table() -> str:
    """Which of the keys some family lacks (FAMILY_KEYS) each family takes: the checks refuse the others."""
    keys = sorted(FAMILY_KEYS)
    rows = ["| family | " + " | ".join(f"`{key}`" for key in keys) + " |", "| --- |" + " --- |" * len(keys)]
    rows += [f"| {f.name} | " + " | ".join("yes" if key in f.takes else "" for key in keys) + " |" for f in FAMILIES]
    return "\n".join(rows)


def family_names() -> str:
    """The families by name, in FAMILIES' order: "GPT-2, Llama, ... and SmolLM3"."""
    names = [f.name for f in FAMILIES]
    return ", ".join(names[:-1]) + " and " + names[-1]


def family_classes() -> str:
    """Their Hugging Face classes, as code: what init_from reads and export_hf.py writes."""
    classes = [f"`{f.hf_class}`" for f in FAMILIES]
    return ", ".join(classes[:-1]) + " or " + classes[-1]


def training_keys() -> str:
    """The model keys that define nothing (model_keys.py's rule): they only say how the model trains."""
    keys = [f"`{name}`" for name in MODEL_FIELDS if name not in DEFINING_KEYS]
    return ", ".join(keys[:-1]) + " and " + keys[-1]


# ---- the TensorBoard tags ----

TAG_OWNERS = (ProgressLog, BatchLoader, ExpertBalance)  # whose tags a run writes: ProgressLog's and the loop's owners'


def _tag_regex(pattern: str) -> re.Pattern:
    """A declared tag as a regex: {a,b} one of those, {name} one part of a path."""
    def part(match: re.Match) -> str:
        inside = match.group(1)
        return "(" + "|".join(map(re.escape, inside.split(","))) + ")" if "," in inside else "[^/]+"
    return re.compile(re.sub(r"\\\{([^}]*)\\\}", lambda m: part(m), re.escape(pattern)))


def undeclared(tags, owners=TAG_OWNERS) -> set[str]:
    """The tags no owner's TAGS declares."""
    patterns = [_tag_regex(p) for owner in owners for p in owner.TAGS]
    return {tag for tag in tags if not any(p.fullmatch(tag) for p in patterns)}


def unwritten(tags, owner) -> set[str]:
    """The tags `owner` declares that none of `tags` is."""
    return {p for p in owner.TAGS if not any(_tag_regex(p).fullmatch(tag) for tag in tags)}


def tags_table() -> str:
    """docs/logging.md's table of every TensorBoard tag (and metrics.jsonl name), by its owner."""
    rows = ["| tag | meaning | written by |", "| --- | --- | --- |"]
    for owner in TAG_OWNERS:
        rows += [f"| `{tag}` | {meaning} | `{owner.__name__}` |" for tag, meaning in owner.TAGS.items()]
    return "\n".join(rows)


# ---- the pages ----

PARTS = {"families": families_table, "family-keys": family_keys_table, "family-names": family_names,
         "family-classes": family_classes, "config-keys": keys_markdown, "training-keys": training_keys,
         "tensorboard-tags": tags_table}
PART = re.compile(r"<!-- generated: ([\w-]+) -->(.*?)<!-- end: \1 -->", re.S)
PAGES = ["README.md", "docs/*.md"]


def pages() -> list[str]:
    return sorted(path for pattern in PAGES for path in glob.glob(os.path.join(ROOT, pattern)))


def generated(name: str) -> str:
    """A part as a page holds it: a table on lines of its own, a phrase within its line."""
    text = PARTS[name]().strip("\n")
    return f"\n{text}\n" if "\n" in text else text


def rewritten(text: str) -> str:
    """A page's text with every generated part made anew."""
    return PART.sub(lambda m: f"<!-- generated: {m.group(1)} -->{generated(m.group(1))}<!-- end: {m.group(1)} -->",
                    text)


def stale() -> list[str]:
    """The pages (relative to the checkout) whose generated parts differ from what rewritten() makes."""
    return [os.path.relpath(path, ROOT) for path in pages() if rewritten(open(path).read()) != open(path).read()]


if __name__ == "__main__":
    for path in pages():
        with open(path) as f:
            text = f.read()
        if (new := rewritten(text)) != text:
            with open(path, "w") as f:
                f.write(new)
            print(f"regenerated {os.path.relpath(path, ROOT)}")
    sys.exit(0)
