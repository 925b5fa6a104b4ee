"""Model families, one entry each: how its layout is built (model.py reads the entry), which keys it
takes (config.py's checks), what a resume may change (checkpoint/ckpt_format.py), and its Hugging
Face class, config.json's keys and the weights' names both ways (hf_format.py). No other module
branches on a family: a new one is an entry in a module of this package, listed in FAMILIES, and its
tests; the docs' table and lists of the families are made from FAMILIES (fsdp_gpt/doc_tables.py;
docs/architecture.md: adding a family). What an entry is made of is family_parts.py.

A family builds one layout, the `arch` key. The table runs from a layout's plain family to its
refinements, each applying where its `when` keys are set: Llama with qk_norm is Qwen3, with experts
Qwen3-MoE. Plain Python, no torch: the config's checks read it too.
"""
from typing import Callable

from fsdp_gpt.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3
from fsdp_gpt.families.gemma3 import GEMMA3
from fsdp_gpt.families.gpt2 import GPT2
from fsdp_gpt.families.gpt_oss import GPT_OSS
from fsdp_gpt.families.llama import LLAMA, QWEN3, QWEN3_MOE
from fsdp_gpt.families.llama_kin import MISTRAL, OLMO2, OLMO3, PHI3, QWEN2, SMOLLM3
from fsdp_gpt.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from fsdp_gpt.family_parts import Family

FAMILIES = (GPT2, LLAMA, QWEN3, QWEN3_MOE, GEMMA3,  # each layout's plain family first, its refinements after it
            QWEN2, MISTRAL, OLMO2, OLMO3, PHI3, SMOLLM3, QWEN3_5, QWEN3_5_MOE, DEEPSEEK_V3, DEEPSEEK_V2, GPT_OSS)
ARCHS = tuple(dict.fromkeys(family.arch for family in FAMILIES))
FAMILY_KEYS = frozenset().union(*(family.takes for family in FAMILIES))  # the keys some family lacks


def layouts() -> str:
    """Each layout with its families, a refinement with the keys that make it (the arch key's meaning)."""
    def named(family: Family) -> str:
        return family.name + (f" with {', '.join(family.when)}" if family.when else "")
    return ", ".join(f"{arch} ({'; '.join(named(f) for f in FAMILIES if f.arch == arch)})" for arch in ARCHS)


def family_of(arch: str, is_set: Callable[[str], bool]) -> Family:
    """The family of a model of layout `arch`: its last entry whose `when` keys are all set (is_set)."""
    return [family for family in FAMILIES if family.arch == arch and all(map(is_set, family.when))][-1]
